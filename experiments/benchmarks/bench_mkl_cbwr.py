"""What MKL's strict reproducibility costs a training step: the pico regime's DDP step (method dp, Muon,
one process) under MKL_CBWR=AUTO,STRICT (what `import muloco` sets: bitwise resumes whatever the operands'
alignment, docs/reliability.md) against MKL_CBWR=AUTO (MKL's fastest reproducible-on-aligned-data mode),
interleaved repeats, each a fresh `muloco train` process.

    python experiments/benchmarks/bench_mkl_cbwr.py --steps 300 --repeats 3

Prints a table (median compute per step, spread, ratio to AUTO) and writes
experiments/benchmarks/results/bench_mkl_cbwr.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "bench_mkl_cbwr.json"
MODES = ("AUTO,STRICT", "AUTO")
BATCH_TOKENS = 2048  # pico's


def step_s(mode: str, steps: int, threads: int) -> float:
    """Compute seconds per inner step of one fresh pico DP run under MKL_CBWR=`mode`."""
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            "method=dp",
            "workers=1",
            f"train.total_tokens={steps * BATCH_TOKENS}",
            f"train.threads={threads}",
            "train.eval_every=0",
            "logging.progress=off",
            f"run.output_dir={out}",
        ]
        env = {**os.environ, "MKL_CBWR": mode}
        cmd = [sys.executable, "-m", "muloco", "train", str(ROOT / "configs/pico.yaml"), *overrides]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=900)
        summary = json.loads(next(Path(out).glob("*/summary.json")).read_text())
    return summary["worker_compute_s"] / summary["inner_steps"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits both modes alike
        for mode in MODES:
            times[mode].append(step_s(mode, args.steps, args.threads))
    base = statistics.median(times["AUTO"])
    rows = []
    print(f"{'MKL_CBWR':<12} {'ms/step':>8} {'spread':>15} {'vs AUTO':>8}")
    for mode in MODES:
        median = statistics.median(times[mode])
        rows.append({"mode": mode, "step_s": times[mode], "median_s": median, "vs_auto": median / base})
        spread = f"{min(times[mode]) * 1e3:.1f}-{max(times[mode]) * 1e3:.1f}"
        print(f"{mode:<12} {median * 1e3:8.1f} {spread:>15} {median / base:7.3f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
