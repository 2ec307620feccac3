"""What each robust sync.aggregate costs when every worker is honest: final val loss per method, K and rule,
from the sweep pico_aggregate (docs/results.md, "Robust aggregation").

    muloco sweep configs/sweeps/pico_aggregate.yaml --jobs 2
    python experiments/paper_check/aggregate_tables.py [--root runs/sweeps] [--json out.json]

"vs mean" is (rule loss / mean loss - 1) x 100 for the same seed (same data order and initialization), then
the mean over seeds, with each seed's value in parentheses.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from muloco.tools.runs import load_runs

OPTIMIZERS = {"adamw": "DiLoCo (AdamW)", "muon": "MuLoCo (Muon)"}
RULES = ["mean", "trimmed_mean", "median", "centered_clip"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/sweeps"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = [r for r in load_runs(args.root / "pico_aggregate") if r.completed]
    loss = {
        (
            r.config["inner.optimizer"],
            r.config["workers"],
            r.config["sync.aggregate"],
            r.config["run.seed"],
        ): r.loss
        for r in runs
    }
    rows, table = [], ["| method | K | rule | loss (seed 0 / 1) | vs mean |", "|---|---|---|---|---|"]
    for opt, label in OPTIMIZERS.items():
        for K in (4, 8):
            for rule in RULES:
                seeds = sorted(s for (o, k, a, s) in loss if (o, k, a) == (opt, K, rule))
                if not seeds:
                    continue
                values = [loss[opt, K, rule, s] for s in seeds]
                diffs = [
                    100 * (loss[opt, K, rule, s] / loss[opt, K, "mean", s] - 1)
                    for s in seeds
                    if (opt, K, "mean", s) in loss
                ]
                mean_diff = statistics.mean(diffs) if diffs else None
                rows.append(
                    {"method": opt, "workers": K, "rule": rule, "losses": values, "vs_mean_pct": diffs}
                )
                shown = " / ".join(f"{v:.4f}" for v in values)
                vs = (
                    ""
                    if rule == "mean" or mean_diff is None
                    else f"{mean_diff:+.2f}% ({' / '.join(f'{d:+.2f}' for d in diffs)})"
                )
                table.append(f"| {label} | {K} | {rule} | {shown} | {vs} |")
    print("\n".join(table))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
