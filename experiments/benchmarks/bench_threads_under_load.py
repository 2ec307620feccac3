"""The quickstart beside other work: wall time of `muloco train configs/quickstart.yaml` on an idle machine,
beside one CPU burner with torch's default threads (one per core), and beside the burner with
train.threads=1 (what the busy-machine warning advises on 2 cores), and whether each run warned. Interleaved
repeats; median and spread.

    python experiments/benchmarks/bench_threads_under_load.py --tokens 122880 --reps 3

--tokens 0 runs the whole quickstart (600k tokens). Prints a table and writes
experiments/benchmarks/results/bench_threads_under_load.json.
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

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "bench_threads_under_load.json"
CASES = {  # name: (burner running, extra overrides)
    "idle, default threads": (False, []),
    "1 burner, default threads": (True, []),
    "1 burner, train.threads=1": (True, ["train.threads=1"]),
}


def quickstart_seconds(tokens: int, extra: list[str], out: Path) -> tuple[float, bool]:
    """(wall seconds, whether the run warned that the machine is busy)."""
    args = [f"run.output_dir={out}", "run.name=q", "checkpoint.resume=never", "logging.progress=off"]
    if tokens:
        args.append(f"train.total_tokens={tokens}")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's own default
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "muloco", "train", str(ROOT / "configs/quickstart.yaml"), *args, *extra]
    done = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, "set train.threads" in done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=122880)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    warned: dict[str, int] = {name: 0 for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            for name, (burn, extra) in CASES.items():
                burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if burn else None
                try:
                    time.sleep(1.0 if burn else 0.0)
                    wall, warning = quickstart_seconds(args.tokens, extra, Path(tmp))
                    seconds[name].append(wall)
                    warned[name] += warning
                finally:
                    if burner is not None:
                        burner.kill()
                        burner.wait()
    base = statistics.median(seconds["idle, default threads"])
    rows = [
        {
            "case": name,
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "vs_idle": statistics.median(v) / base,
            "warned": f"{warned[name]}/{len(v)}",
        }
        for name, v in seconds.items()
    ]
    print(f"quickstart, {args.tokens or 'all'} tokens, {os.cpu_count()} cores, {args.reps} interleaved reps")
    print(f"{'case':28} {'median s':>9} {'min':>7} {'max':>7} {'x idle':>7} {'warned':>7}")
    for r in rows:
        line = f"{r['case']:28} {r['median_s']:9.1f} {r['min_s']:7.1f} {r['max_s']:7.1f} {r['vs_idle']:7.2f}"
        print(f"{line} {r['warned']:>7}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"tokens": args.tokens, "reps": args.reps, "rows": rows}, indent=2))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
