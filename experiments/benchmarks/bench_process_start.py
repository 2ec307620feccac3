"""What starting a run costs: a batch of N tiny `muloco train` runs, one after another, started as fresh
`python -m muloco` processes and forked from the preloaded server (muloco/net/preloaded.py, what `muloco
sweep` and `muloco launch` use), in interleaved repeats; the batch's wall time and the machine's CPU
seconds over it (from /proc/stat: run it on a quiet machine). Each preloaded batch runs in a new driver
process, so it pays for its server's start, as a sweep does.

    python experiments/benchmarks/bench_process_start.py --runs 6 --reps 3

Prints a table and writes experiments/benchmarks/results/bench_process_start.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "bench_process_start.json"
TINY = [  # tests/conftest.py's tiny run: about a second of training on 2 cores
    *("model.preset=nano", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32"),
    *("train.batch_tokens=256", "train.total_tokens=3072", "train.eval_every=4", "train.eval_tokens=512"),
    *("train.warmup_steps=2", "logging.progress=off", "sync.every=3", "train.threads=1"),
]
DRIVER = """
import os, subprocess, sys
from muloco.net.preloaded import start_muloco
mode, runs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = ["train", os.path.join(sys.argv[4], "configs/quickstart.yaml"), *sys.argv[5:]]
for i in range(runs):
    os.environ["MULOCO_PRELOAD"] = "1" if mode == "preloaded" else "0"
    p = start_muloco([*args, f"run.output_dir={out}", f"run.name=r{i}"], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    assert p.wait() == 0, (mode, i)
"""


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat's cpu line, less idle)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / 100.0  # USER_HZ is 100 on Linux


def batch(mode: str, runs: int, out: Path) -> tuple[float, float]:
    """(wall s, busy CPU s) of one driver process starting `runs` runs one after another."""
    cpu0, t0 = busy_cpu_seconds(), time.perf_counter()
    cmd = [sys.executable, "-c", DRIVER, mode, str(runs), str(out), str(ROOT), *TINY]
    subprocess.run(cmd, check=True, cwd=ROOT)
    time.sleep(0.5)  # the preloaded server reads its socket's end and exits
    return time.perf_counter() - t0, busy_cpu_seconds() - cpu0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    modes = ("fresh", "preloaded")
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:  # interleaved, alternating order
                w, c = batch(mode, args.runs, Path(tmp) / f"{mode}{rep}")
                wall[mode].append(w)
                cpu[mode].append(c)
    rows = {}
    print(f"{args.runs} tiny runs one after another, {args.reps} interleaved repeats (median, min-max)")
    print(f"{'start':<10} {'wall s':>22} {'CPU s':>22} {'per run s':>10}")
    for mode in modes:
        rows[mode] = {
            "wall_s": wall[mode],
            "cpu_s": cpu[mode],
            "wall_median": statistics.median(wall[mode]),
            "cpu_median": statistics.median(cpu[mode]),
        }
        w, c = rows[mode]["wall_median"], rows[mode]["cpu_median"]
        print(
            f"{mode:<10} {w:>8.1f} ({min(wall[mode]):.1f}-{max(wall[mode]):.1f})"
            f" {c:>10.1f} ({min(cpu[mode]):.1f}-{max(cpu[mode]):.1f}) {w / args.runs:>10.2f}"
        )
    ratios = {
        "wall": rows["preloaded"]["wall_median"] / rows["fresh"]["wall_median"],
        "cpu": rows["preloaded"]["cpu_median"] / rows["fresh"]["cpu_median"],
    }
    print(f"preloaded / fresh: wall {ratios['wall']:.2f}x, CPU {ratios['cpu']:.2f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps({"runs": args.runs, "reps": args.reps, "rows": rows, "ratios": ratios}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
