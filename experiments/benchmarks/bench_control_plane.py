"""What a sync's small collectives cost over a slow link, at two git revisions side by side.

A round's own traffic is a payload, but over a link with latency its small collectives (a size exchange
before an all-gather, the stop agreement, the log line's all-reduce) each cost a round trip or more: at
20 ms one way a 4-rank ring all-reduce of one float takes ~6 x 20 ms, as long as a pico round's compute.
This runs each case over the same 4-host testbed link (tbf rate, the hub's delay line) at revision --old
and --new (git worktrees, first on PYTHONPATH of every training process), interleaved, --repeats times,
and reports the median train time per inner step, its spread (min-max) and the ratio new / old, and the
share of the train time spent waiting on communication (summary.json's comm_wait_s).

    python experiments/benchmarks/bench_control_plane.py --old ae6fc48 --new HEAD --repeats 3
    python experiments/benchmarks/bench_control_plane.py --probe-only --out .../control_plane_probe.json

Needs root and iproute2 (the testbed). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from muloco.testbed.network import Testbed, missing_requirements
from muloco.testbed.probe import time_collectives
from muloco.testbed.train import train_on_testbed

ROOT = Path(__file__).resolve().parents[2]
FOUR_BIT = ["compression.scheme=statistical", "compression.bits=4", "compression.error_feedback=true"]
# name: (overrides, inner steps, per-step timing). Pico at its tuned lr (docs/results.md); H = 15.
CASES = {
    "MuLoCo 4-bit": ([*FOUR_BIT, "inner.lr=0.02"], 150, False),
    "streaming MuLoCo 4-bit P=3 tau=4": (
        [*FOUR_BIT, "inner.lr=0.02", "sync.fragments=3", "sync.overlap=4"],
        150,
        False,
    ),
    "DDP fp32": (["method=dp", "inner.lr=0.02", "train.log_every=1"], 30, True),
    # MuLoCo 4-bit above takes reduce_scatter too (`auto` at K = 4 with no overlap).
    "MuLoCo 2-bit reduce-scatter": (
        [
            *FOUR_BIT[:1],
            "compression.bits=2",
            *FOUR_BIT[2:],
            "inner.lr=0.02",
            "sync.transport=reduce_scatter",
        ],
        150,
        False,
    ),
}
WARMUP = 5  # a per-step case's first steps, left out of its median
# The probe's collectives: a small all-reduce (the stop agreement's) and all-gathers of a size exchange, a
# 4-bit pico fragment and a 4-bit pico model, each after a 0.2 s pause (muloco.testbed.probe).
PROBE_OPS = [("all_reduce 1 float", "all_reduce", 4)]
PROBE_OPS += [(f"all_gather {n:,} B", "all_gather", n) for n in (8, 30_000, 100_000)]


def probe_collectives(testbed: Testbed) -> dict:
    """Median seconds of a small all-reduce and all-gathers of a few sizes over the testbed's links."""
    return time_collectives(testbed, PROBE_OPS, pause_s=0.2)


def worktree(rev: str, where: Path) -> Path:
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev], check=True)
    return path


def run_case(testbed: Testbed, tree: Path, case: str, out: Path) -> dict:
    overrides, steps, per_step = CASES[case]
    name = "bench"
    shutil.rmtree(out, ignore_errors=True)
    args = [
        *overrides,
        "workers=4",
        f"train.total_tokens={steps * 2048}",
        "train.eval_every=0",
        "train.eval_tokens=2048",
        f"run.output_dir={out}",
        f"run.name={name}",
        "checkpoint.every=0",
        "checkpoint.resume=never",
        "logging.progress=off",
    ]
    # The training processes import this revision's muloco: first on PYTHONPATH, and their working
    # directory (`python -m` puts it before PYTHONPATH on sys.path).
    os.environ["PYTHONPATH"] = str(tree)
    here = os.getcwd()
    os.chdir(tree)
    try:
        imported = testbed.run(0, [sys.executable, "-c", "import muloco; print(muloco.__file__)"]).strip()
        if not imported.startswith(str(tree)):
            raise RuntimeError(f"{tree.name}: the hosts import muloco from {imported}, not {tree}")
        run = train_on_testbed(testbed, str(tree / "configs/pico.yaml"), args, out / "logs", "torch", 900)
    finally:
        os.chdir(here)
    if not run.ok:
        raise RuntimeError(f"{case} at {tree.name} failed (exit codes {run.returncodes}); see {run.logs}")
    summary = json.loads((out / name / "summary.json").read_text())
    train_s = summary["tokens_seen"] / summary["train_tokens_per_s"]
    result = {"s_per_step": train_s / summary["inner_steps"], "wait": summary["comm_wait_s"] / train_s}
    if per_step:
        records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        times = [r["time_s"] for r in records if r["kind"] == "train"]
        result["s_per_step"] = statistics.median(
            [b - a for a, b in zip(times, times[1:], strict=False)][WARMUP - 1 :]
        )
    return result


def summarize(case: str, by: dict) -> dict:
    row = {"case": case}
    for which in ("old", "new"):
        steps = [r["s_per_step"] for r in by[which]]
        row[which] = {
            "s_per_step": statistics.median(steps),
            "spread": [min(steps), max(steps)],
            "wait": statistics.median(r["wait"] for r in by[which]),
            "runs": by[which],
        }
    row["new_over_old"] = row["new"]["s_per_step"] / row["old"]["s_per_step"]
    return row


def format_table(rows: list[dict], shas: dict) -> str:
    def cell(x: dict) -> str:
        low, high = x["spread"]
        return f"{x['s_per_step'] * 1e3:.0f} ({low * 1e3:.0f}-{high * 1e3:.0f}) ms"

    header = f"{'case':34} {'old ' + shas['old']:>18} {'new ' + shas['new']:>18} {'new/old':>8} {'wait':>11}"
    lines = [header, "-" * len(header)]
    for row in rows:
        o, n = row["old"], row["new"]
        wait = f"{o['wait']:.0%} > {n['wait']:.0%}"
        lines.append(f"{row['case']:34} {cell(o):>18} {cell(n):>18} {row['new_over_old']:>8.2f} {wait:>11}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the revision to compare against (needed unless --probe-only)")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=7.4, help="bench_wan.py --quick's ratio-50 link")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--probe-only", action="store_true", help="time the collectives, no training runs")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments/benchmarks/results/control_plane.json")
    args = ap.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"bench_control_plane: cannot run: {reason}", file=sys.stderr)
        return 2
    if args.probe_only:
        with Testbed(4, args.rate_mbit, args.delay_ms) as testbed:
            probe = probe_collectives(testbed)
        print(f"link {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way, 4 hosts (gloo, median of 10)")
        for name, seconds in probe.items():
            print(f"  {name:24} {seconds * 1e3:6.0f} ms")
        saved = {"command": " ".join(sys.argv), "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**saved, "collectives_s": probe}, indent=1))
        print(f"wrote {args.out}")
        return 0
    if not args.old:
        print("bench_control_plane: --old REV is needed (or --probe-only)", file=sys.stderr)
        return 2
    revs = {"old": args.old, "new": args.new}
    shas = {
        k: subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", r], text=True).strip()
        for k, r in revs.items()
    }
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"bench_control_plane: --cases: unknown {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    results: dict = {case: {"old": [], "new": []} for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {k: worktree(shas[k], Path(tmp)) for k in revs}
        try:
            with Testbed(4, args.rate_mbit, args.delay_ms) as testbed:
                for rep in range(args.repeats):
                    for case in cases:
                        for which in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                            r = run_case(testbed, trees[which], case, Path(tmp) / "runs")
                            results[case][which].append(r)
                            print(f"rep {rep + 1} {case} {which}: {r}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
                )
    rows = [summarize(case, by) for case, by in results.items()]
    print(f"link {args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way, 4 hosts")
    print(format_table(rows, shas))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    saved = {
        "command": " ".join(sys.argv),
        "old": shas["old"],
        "new": shas["new"],
        "rate_mbit": args.rate_mbit,
        "delay_ms": args.delay_ms,
        "repeats": args.repeats,
        "rows": rows,
    }
    args.out.write_text(json.dumps(saved, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
