"""Training tokens/s with and without `model.compile` (torch.compile) on the `small` preset.

Each case runs in its own subprocess, in interleaved order, `--repeats` times. Inside a child a short
warm-up run compiles (its wall time is reported as the compile cost) and a second run in the same process
is measured: compiled code is reused across runs, replicas and rounds, so the measured run holds no
compilation. tokens/s excludes evals (summary.json's train_tokens_per_s).

    python experiments/benchmarks/bench_compile.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = [
    "model.preset=small",
    "model.seq_len=128",
    "train.batch_tokens=4096",  # 32 sequences of 128
    "train.eval_every=0",
    "train.eval_tokens=1024",
    "train.warmup_steps=2",
    "sync.every=5",
    "logging.progress=off",
    "checkpoint.every=0",
    "checkpoint.resume=never",
    "inner.optimizer=muon",
]
CASES = {
    "dp": ["method=dp", "workers=1"],
    "diloco K=4": ["method=diloco", "workers=4"],
}


def run_one(overrides: list[str], steps: int) -> dict:
    """In the child: a 2-step warm-up run (compiles when asked), then the measured run."""
    from muloco.config import load_config
    from muloco.run.trainer import Trainer

    started = time.perf_counter()
    Trainer(load_config(None, [*overrides, "train.total_tokens=8192", "run.name=warmup"])).run()
    warmup_s = time.perf_counter() - started
    summary = Trainer(load_config(None, [*overrides, f"train.total_tokens={4096 * steps}"])).run()
    return {
        "train_tokens_per_s": summary["train_tokens_per_s"],
        "final_val_loss": summary["final_val_loss"],
        "warmup_s": round(warmup_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="inner steps of the measured run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="experiments/benchmarks/results/bench_compile.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one), args.steps)))
        return

    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for case, overrides in CASES.items():
                for compiled in (False, True):
                    name = f"{case} {'compiled' if compiled else 'eager'}"
                    full = [
                        *BASE,
                        *overrides,
                        f"model.compile={str(compiled).lower()}",
                        f"run.output_dir={tmp}/{repeat}/{name.replace(' ', '_')}",
                    ]
                    out = subprocess.run(
                        [sys.executable, __file__, "--one", json.dumps(full), "--steps", str(args.steps)],
                        capture_output=True,
                        text=True,
                        check=True,
                        env=os.environ,
                    )
                    results.setdefault(name, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(f"  done {name} repeat={repeat}", file=sys.stderr, flush=True)

    rows = []
    for case in CASES:
        eager, compiled = results[f"{case} eager"], results[f"{case} compiled"]
        ratios = [
            c["train_tokens_per_s"] / e["train_tokens_per_s"] for e, c in zip(eager, compiled, strict=True)
        ]
        for name, runs in ((f"{case} eager", eager), (f"{case} compiled", compiled)):
            tps = [r["train_tokens_per_s"] for r in runs]
            rows.append(
                {
                    "case": name,
                    "train_tokens_per_s": statistics.median(tps),
                    "spread": [min(tps), max(tps)],
                    "warmup_s": statistics.median(r["warmup_s"] for r in runs),
                    "compiled_over_eager": (
                        [round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)]
                        if runs is compiled
                        else None
                    ),
                    "final_val_loss": runs[0]["final_val_loss"],
                }
            )
    print(f"\nmodel.compile on the small preset, CPU threads={os.cpu_count()}, repeats={args.repeats}")
    print(
        f"{'case':<22}{'tokens/s':>10}{'min-max':>16}{'warm-up s':>11}{'x eager (min-max)':>22}"
        f"{'val loss':>10}"
    )
    for r in rows:
        ratio = r["compiled_over_eager"]
        ratio_text = f"{ratio[0]:.3f} ({ratio[1]:.2f}-{ratio[2]:.2f})" if ratio else "-"
        spread = f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f}"
        print(
            f"{r['case']:<22}{r['train_tokens_per_s']:>10.0f}{spread:>16}{r['warmup_s']:>11.1f}"
            f"{ratio_text:>22}{r['final_val_loss']:>10.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "raw": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
