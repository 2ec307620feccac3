"""What the testbed's user-space delay line carries (muloco/testbed/delay_line.py): round trip and TCP goodput
between two hosts, with the hub's kernel bridge (no delay) and with the delay line at a cross-site one-way
delay, at link rates from tens of Mbit/s to 1 Gbit/s; interleaved repeats, medians with their range.

    python experiments/benchmarks/bench_delay_line.py --rates 50 100 200 500 1000 --delay-ms 25 --reps 3

Root, on a quiet machine. Each transfer is sized to ~3 s at the link's rate (at least 4 MB), so TCP's slow
start over the delayed round trips is a small part of it. Prints a table and writes
experiments/benchmarks/results/bench_delay_line.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from muloco.net.wan import TCP_PAYLOAD_EFFICIENCY
from muloco.testbed.network import Testbed
from muloco.testbed.probe import goodput_mbit, median_round_trip_ms

OUT = Path(__file__).parent / "results" / "bench_delay_line.json"


def measure(rate: float, delay_ms: float, seconds: float) -> dict:
    size = max(4_000_000, int(rate * 1e6 / 8 * seconds))
    with Testbed(2, rate, delay_ms=delay_ms) as testbed:
        round_trip = median_round_trip_ms(testbed, 0, 1)
        goodput = goodput_mbit(testbed, 0, 1, size)
    return {"round_trip_ms": round_trip, "goodput_mbit": goodput, "bytes": size}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 500, 1000])
    parser.add_argument("--delay-ms", type=float, default=25.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="each transfer's length at the rate")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_delay_line: needs root (network namespaces)")
    cases = [(rate, delay) for rate in args.rates for delay in (0.0, args.delay_ms)]
    samples: dict[tuple[float, float], list[dict]] = {case: [] for case in cases}
    for rep in range(args.reps):  # interleaved: every case once per repeat
        for rate, delay in cases:
            result = measure(rate, delay, args.seconds)
            samples[(rate, delay)].append(result)
            print(f"rep {rep} rate={rate:g} delay={delay:g}: {result}", flush=True)

    rows = []
    for rate, delay in cases:
        runs = samples[(rate, delay)]
        goodput = spread([r["goodput_mbit"] for r in runs])
        rows.append(
            {
                "rate_mbit": rate,
                "one_way_delay_ms": delay,
                "forwarding": "delay line" if delay else "kernel bridge",
                "round_trip_ms": spread([r["round_trip_ms"] for r in runs]),
                "goodput_mbit": goodput,
                "of_tcp_line_rate": goodput["median"] / (rate * TCP_PAYLOAD_EFFICIENCY),
            }
        )
    print()
    header = ["rate Mbit/s", "forwarding", "one-way delay", "round trip ms (median, range)", "goodput Mbit/s"]
    print("| " + " | ".join([*header, "of TCP line rate"]) + " |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rt, gp = row["round_trip_ms"], row["goodput_mbit"]
        print(
            f"| {row['rate_mbit']:g} | {row['forwarding']} | {row['one_way_delay_ms']:g} ms | "
            f"{rt['median']:.2f} ({rt['min']:.2f}-{rt['max']:.2f}) | {gp['median']:.1f} ({gp['min']:.1f}-"
            f"{gp['max']:.1f}) | {row['of_tcp_line_rate']:.2f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
