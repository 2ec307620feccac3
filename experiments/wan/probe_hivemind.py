"""What a hivemind sync costs beyond its bytes, against the link's delay: the planner's model of the
headline's hivemind row (issue 36).

The hivemind row's sync is matchmaking (a DHT round to find the group), then each member downloading the
others' payloads over p2pd streams, then the combine; gloo's collectives have none of the first and their
own framing for the second, so the collectives' model (muloco.net.wan) under-counts it. Here the headline's
own hivemind row (pico, MuLoCo 4-bit, a group of all 4) runs over the testbed at a rate where its bytes
take milliseconds, at several one-way delays; its cost per sync beyond compute (train time less compute,
per sync, the bytes' time at the rate taken out) is fitted as local + round trips x round-trip time by least
squares. bench_wan's report gives the hivemind rows that local cost and those round trips
(wan_report.HIVEMIND_PROBE).

    python experiments/wan/probe_hivemind.py [--rate-mbit 1000] [--delays-ms 0 4 20] [--syncs 30]
        [--repeats 2] [--out experiments/wan/results/probe_hivemind.json]

Needs root (the testbed). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
from pathlib import Path

from wan_rows import ROWS
from wan_runs import on_link

from muloco.net.wan import Link
from muloco.testbed.network import Testbed, missing_requirements

HERE = Path(__file__).resolve().parent
WORKERS = 4
BATCH_TOKENS = 2048  # pico's
SYNC_EVERY = 15  # pico's H
PHASES = re.compile(r"matchmaking_s=([0-9.]+) exchange_s=([0-9.]+) combine_s=([0-9.]+)")


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def one_run(rate: float, delay_ms: float, syncs: int, workdir: Path) -> dict:
    row = ROWS["hivemind_4bit"]
    with Testbed(WORKERS, rate, delay_ms) as testbed:
        run = on_link(testbed, row, syncs * SYNC_EVERY, BATCH_TOKENS, workdir, 10**9, None)
    s = run["summary"]
    train_s = s["tokens_seen"] / s["train_tokens_per_s"]
    bytes_s = Link(rate, delay_ms).seconds(s["bytes_sent_per_worker"] / s["fragment_syncs"], 0)
    logs = "".join(p.read_text() for p in workdir.glob("*.logs/*"))
    phases = [tuple(map(float, m)) for m in PHASES.findall(logs)]
    return {
        "delay_ms": delay_ms,
        "syncs": s["fragment_syncs"],
        "sync_s": (train_s - s["worker_compute_s"]) / s["fragment_syncs"] - bytes_s,
        "bytes_s": bytes_s,
        "matchmaking_s": statistics.median(p[0] for p in phases),
        "exchange_s": statistics.median(p[1] for p in phases),
        "combine_s": statistics.median(p[2] for p in phases),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=1000.0)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 4.0, 20.0])
    ap.add_argument("--syncs", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2, help="every delay this many times, interleaved")
    ap.add_argument("--out", type=Path, default=HERE / "results/probe_hivemind.json")
    ap.add_argument("--workdir", type=Path, default=HERE.parents[1] / "runs/probe_hivemind")
    args = ap.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"probe_hivemind: cannot run: {reason}", file=sys.stderr)
        return 2
    rows = []
    for repeat in range(args.repeats):
        for delay in args.delays_ms:
            workdir = args.workdir / f"r{repeat}_{delay:g}ms"
            shutil.rmtree(workdir, ignore_errors=True)  # a failed run's stays for its logs
            rows.append({**one_run(args.rate_mbit, delay, args.syncs, workdir), "repeat": repeat})
            print(json.dumps(rows[-1]), flush=True)
    round_trip_s = [2 * r["delay_ms"] / 1e3 for r in rows]
    local_s, round_trips = fit_line(round_trip_s, [r["sync_s"] for r in rows])
    print(f"{args.rate_mbit:g} Mbit/s, 4 hosts, the headline's hivemind row, {args.syncs} syncs per run")
    print(
        f"{'delay ms':>8} {'sync s':>7} {'fit s':>7} {'matchmaking s':>13} {'exchange s':>10} "
        f"{'combine s':>9}"
    )
    for r, rtt in zip(rows, round_trip_s, strict=True):
        print(
            f"{r['delay_ms']:>8g} {r['sync_s']:>7.3f} {local_s + round_trips * rtt:>7.3f} "
            f"{r['matchmaking_s']:>13.3f} {r['exchange_s']:>10.3f} {r['combine_s']:>9.3f}"
        )
    print(f"fit: {local_s * 1e3:.0f} ms local + {round_trips:.1f} round trips per sync")
    record = {
        "command": " ".join(sys.argv),
        "rate_mbit": args.rate_mbit,
        "rows": rows,
        "local_s": local_s,
        "round_trips": round_trips,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
