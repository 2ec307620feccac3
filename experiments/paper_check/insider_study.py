"""One insider against the mean and the trimmed mean, in the simulation (docs/results.md, "Robust
aggregation"): the test setting of tests/comm/test_aggregate.py (the tiny GPT, AdamW 3e-3, H = 3, 8 syncs
at K = 4, 5; 8 at K = 8), the last replica sending -4 x its pseudogradient every sync (under hivemind's
default norm bound). Each cell: final val loss relative to the all-honest run of the same seed.

    python experiments/paper_check/insider_study.py [--seeds 0 1 2 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import TINY  # noqa: E402

from muloco.config import load_config  # noqa: E402
from muloco.run.replica import Replica  # noqa: E402
from muloco.run.trainer import Trainer  # noqa: E402

HONEST = Replica.pseudogradient
SETTINGS = [(4, 12288), (5, 15360), (8, 24576)]  # K, tokens: 8 syncs at H = 3 (24 at K = 8)


def final_loss(overrides: list[str], insider: int | None) -> float:
    def pseudogradient(self, global_params, indices=None):
        delta = HONEST(self, global_params, indices)
        return [d * -4.0 for d in delta] if self.index == insider else delta

    Replica.pseudogradient = pseudogradient
    try:
        return Trainer(load_config(None, overrides)).run()["final_val_loss"]
    finally:
        Replica.pseudogradient = HONEST


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print("| K | seed | all honest | insider, trimmed_mean | insider, mean |")
    print("|---|---|---|---|---|")
    for K, tokens in SETTINGS:
        for seed in args.seeds:
            base = [*TINY, f"workers={K}", f"train.batch_tokens={128 * K}", f"train.total_tokens={tokens}"]
            base += ["sync.every=3", "inner.optimizer=adamw", "inner.lr=3e-3", f"run.seed={seed}"]
            base += [f"run.output_dir={tempfile.mkdtemp(prefix='insider_')}"]
            honest = final_loss([*base, "run.name=honest"], None)
            trimmed = final_loss([*base, "run.name=trimmed", "sync.aggregate=trimmed_mean"], K - 1)
            mean = final_loss([*base, "run.name=mean"], K - 1)
            row = {"workers": K, "seed": seed, "honest": honest, "trimmed_mean": trimmed, "mean": mean}
            rows.append(row)
            print(
                f"| {K} | {seed} | {honest:.4f} | {trimmed:.4f} ({100 * (trimmed / honest - 1):+.2f}%) | "
                f"{mean:.4f} ({100 * (mean / honest - 1):+.1f}%) |",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
