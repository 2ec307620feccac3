"""Time the headline's collectives over one testbed link: what the planner's latency term must account for.

Each op runs 12 times on 4 hosts (gloo), after a barrier and a pause (--pause-s: ~30 ms is a DDP step's
compute between all-reduces, ~0.5 s a MuLoCo round's between syncs, longer than TCP's retransmission
timeout, after which Linux restarts an idle connection's window from 10 segments unless the host sets
net.ipv4.tcp_slow_start_after_idle=0); the median of the last 10, against the planner's seconds for it.

    python experiments/wan/probe_collectives.py --rate-mbit 350 --delay-ms 20 [--pause-s 0.5]
        [--slow-start-after-idle 0|1] [--all-reduce-sizes BYTES ...] [--out ...probe_collectives.json]

--all-reduce-sizes: all-reduces of these sizes instead of the headline's ops (how gloo's ring round trips
grow with the buffer: it cuts it into segments of at most 1 MiB, at least 2 per rank, two in flight).

    python experiments/wan/probe_collectives.py --loopback [--repeats 3] \
        --out experiments/wan/results/probe_collectives_loopback.json

--loopback: the same ops among 4 processes on this machine's loopback, no link (no root): what the
headline's loopback runs paid for each collective, which the planner check does not count twice
(wan_report.py).

Needs root (the testbed, not --loopback). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from muloco.net.wan import Link, allgather_seconds, allreduce_seconds, reduce_scatter_seconds
from muloco.testbed.network import Testbed, missing_requirements
from muloco.testbed.probe import time_collectives

HERE = Path(__file__).resolve().parent
WORKERS = 4
PICO_PARAMS = 184_768  # configs/pico.yaml
# (name, op, bytes per rank): DDP's and fp32 DiLoCo's all-reduce; a 4-bit pico message (all-gather) and
# a fragment of it (streaming, P = 3); one float (the control plane's). Reduce-scatter: (name, op, message
# bytes, owners' mean bytes) of the 4-bit and 2-bit rows (their counted bytes per sync, 3/4 (P + Q)).
OPS = [
    ("all_reduce fp32 pico", "all_reduce", 4 * PICO_PARAMS),
    ("all_gather 4-bit pico", "all_gather", 110_424),
    ("all_gather 4-bit fragment", "all_gather", 36_808),
    ("all_reduce 1 float", "all_reduce", 4),
    # DDP + bf16's bucket; DDP + PowerSGD r4's three all-reduces (torch's powerSGD_hook on pico: the 1-D
    # tensors uncompressed, then P, then Q; their fp32 bytes, muloco/run/ddp_hooks.py books the same).
    ("all_reduce bf16 pico", "all_reduce_bf16", 2 * PICO_PARAMS),
    ("all_reduce PowerSGD r4 uncompressed", "all_reduce", 1_792),
    ("all_reduce PowerSGD r4 P", "all_reduce", 36_864),
    ("all_reduce PowerSGD r4 Q", "all_reduce", 24_576),
    ("reduce_scatter 4-bit pico", "reduce_scatter", 110_004, 220_296),
    ("reduce_scatter 2-bit pico", "reduce_scatter", 63_812, 110_104),
    # Sparse MuLoCo (wan_rows.py's muloco_sparse): its message at pico, 3.125% of each tile at 2 bits
    ("all_gather sparse pico", "all_gather", 11_853),
]


def planned(link: Link, kind: str, size: int, *mean: int) -> float:
    if kind == "reduce_scatter":
        return reduce_scatter_seconds(link, size, mean[0], WORKERS)
    return (allreduce_seconds if kind.startswith("all_reduce") else allgather_seconds)(link, size, WORKERS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, help="the link (without --loopback)")
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--loopback", action="store_true", help="4 processes on this machine's loopback")
    ap.add_argument("--pause-s", type=float, nargs="+", default=[0.03, 0.5])
    ap.add_argument("--slow-start-after-idle", type=int, nargs="+", default=[1, 0], choices=[0, 1])
    ap.add_argument("--all-reduce-sizes", type=int, nargs="+", help="bytes per rank (instead of OPS)")
    ap.add_argument("--repeats", type=int, default=3, help="--loopback: runs (median, spread)")
    ap.add_argument("--out", type=Path, default=HERE / "results/probe_collectives.json")
    args = ap.parse_args()
    ops = OPS
    if args.all_reduce_sizes:
        ops = [(f"all_reduce {size:,} B", "all_reduce", size) for size in args.all_reduce_sizes]
    if args.loopback:
        return loopback(args, ops)
    if args.rate_mbit is None:
        print("probe_collectives: --rate-mbit is needed (or --loopback)", file=sys.stderr)
        return 2
    reason = missing_requirements()
    if reason:
        print(f"probe_collectives: cannot run: {reason}", file=sys.stderr)
        return 2
    link, rows = Link(args.rate_mbit, args.delay_ms), []
    with Testbed(WORKERS, args.rate_mbit, args.delay_ms) as testbed:
        for restart in args.slow_start_after_idle:
            for host in testbed.hosts:
                testbed.run(host.index, ["sysctl", "-qw", f"net.ipv4.tcp_slow_start_after_idle={restart}"])
            for pause in args.pause_s:
                measured = time_collectives(testbed, ops, pause)
                for name, kind, size, *mean in ops:
                    plan = planned(link, kind, size, *mean)
                    rows.append(
                        {
                            "op": name,
                            "bytes": size,
                            "slow_start_after_idle": restart,
                            "pause_s": pause,
                            "measured_s": measured[name],
                            "planner_s": plan,
                        }
                    )
    print(f"{args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one way, 4 hosts (gloo); median of 10")
    print(f"{'op':<28} {'restart':>7} {'pause s':>7} {'measured ms':>11} {'planner ms':>10} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['op']:<28} {r['slow_start_after_idle']:>7} {r['pause_s']:>7g} "
            f"{1e3 * r['measured_s']:>11.1f} {1e3 * r['planner_s']:>10.1f} "
            f"{r['measured_s'] / r['planner_s']:>6.2f}"
        )
    record = {"command": " ".join(sys.argv), "rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms}
    return write(args, {**record, "rows": rows})


def loopback(args: argparse.Namespace, ops: list[tuple]) -> int:
    """Each op's time with no link (4 processes on 127.0.0.1, as bench_wan.py's curves run): what a run's
    loopback-measured compute or local cost already holds of its collectives (wan_report.py). --repeats
    runs, the pauses interleaved; their median and spread."""
    runs: dict[float, list[dict]] = {pause: [] for pause in args.pause_s}
    for _ in range(args.repeats):
        for pause in args.pause_s:
            runs[pause].append(time_collectives(None, ops, pause))
    rows = []
    for pause, measured in runs.items():
        for name, _, size, *_ in ops:
            times = [m[name] for m in measured]
            rows.append(
                {
                    "op": name,
                    "bytes": size,
                    "pause_s": pause,
                    "measured_s": statistics.median(times),
                    "runs_s": times,
                }
            )
    print(f"loopback (127.0.0.1), 4 processes (gloo); each run the median of 10, over {args.repeats} runs")
    print(f"{'op':<36} {'pause s':>7} {'median ms':>9} {'min-max ms':>14}")
    for r in rows:
        spread = f"{1e3 * min(r['runs_s']):.2f}-{1e3 * max(r['runs_s']):.2f}"
        print(f"{r['op']:<36} {r['pause_s']:>7g} {1e3 * r['measured_s']:>9.2f} {spread:>14}")
    return write(args, {"command": " ".join(sys.argv), "loopback": True, "rows": rows})


def write(args: argparse.Namespace, record: dict) -> int:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
