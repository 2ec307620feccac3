"""DDP's gradient buckets over the WAN headline's links: does a smaller bucket (dp.bucket_mb), whose
all-reduce starts while the backward goes on, make the DDP baseline faster? (issue 59, part 4)

At pico the whole gradient (739 KB) fits torch's first bucket (1 MiB), so by default DDP all-reduces it
once, when the backward ends: nothing overlaps. Smaller buckets start earlier, each with its own ring of
round trips. Each case runs DDP fp32 (configs/pico.yaml, method dp, K = 4 hosts of the testbed, one worker
each) for a window of steps over the headline's links and takes the median step time (all-reduces
included), the cases interleaved within each of --repeats repetitions. The table gives each case's median
step time (min-max over the repeats) and its ratio to torch's default buckets.

    python experiments/benchmarks/bench_ddp_buckets.py --repeats 3        # ~8 min, root (namespaces)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "wan"))

from wan_rows import DP, Row  # noqa: E402
from wan_runs import on_link  # noqa: E402

from muloco.testbed.network import Testbed, missing_requirements  # noqa: E402

OUT = Path(__file__).parent / "results" / "bench_ddp_buckets.json"
BATCH_TOKENS = 2048  # pico's
# The headline's ratio-5 and ratio-0.5 links (experiments/wan/results/wan_headline_r5_repeats.json,
# wan_headline_r0.5_repeats.json): where communication is comparable to compute, overlap can pay. At ratio
# 50 a step is ~50x its compute: hiding the backward could save ~1% of it.
LINKS = {"ratio 5": (42.39, 6.0), "ratio 0.5": (423.86, 0.0)}
CASES = {"torch default (1 MiB first)": None, "0.25 MiB": 0.25, "0.1 MiB": 0.1}


def row(bucket_mb: float | None) -> Row:
    extra = () if bucket_mb is None else (f"dp.bucket_mb={bucket_mb}",)
    return Row(f"ddp_b{bucket_mb or 'default'}".replace(".", "p"), "DDP fp32", (*DP, *extra), per_step=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=40, help="timed steps per run (after 5 warm-up steps)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"bench_ddp_buckets: needs the testbed: {missing}")
    started = time.perf_counter()
    results: dict[str, dict[str, list[dict]]] = {link: {case: [] for case in CASES} for link in LINKS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for link, (rate, delay) in LINKS.items():
                with Testbed(4, rate, delay) as testbed:
                    for case, bucket_mb in CASES.items():
                        run = on_link(testbed, row(bucket_mb), 0, BATCH_TOKENS, Path(tmp), 0, args.window)
                        buckets = run["summary"]["dp_bucket_bytes"]
                        results[link][case].append(
                            {
                                "step_s": run["step_s_median"],
                                "spread": run["step_s_spread"],
                                "buckets": buckets,
                            }
                        )
                        print(f"rep {rep} {link} {case}: {run['step_s_median'] * 1e3:.1f} ms/step, "
                              f"buckets {buckets}", flush=True)  # fmt: skip
    table = {}
    print(f"\n{'link':<10} {'buckets':<28} {'step (min-max)':>24} {'vs default':>11}")
    for link, cases in results.items():
        default = statistics.median(r["step_s"] for r in cases[next(iter(CASES))])
        for case, runs in cases.items():
            steps = [r["step_s"] for r in runs]
            med = statistics.median(steps)
            table[f"{link} {case}"] = {
                "link": dict(zip(("rate_mbit", "delay_ms"), LINKS[link], strict=True)),
                "bucket_mb": CASES[case], "buckets": runs[0]["buckets"], "step_s_median": med,
                "step_s_min": min(steps), "step_s_max": max(steps), "vs_default": med / default, "runs": runs,
            }  # fmt: skip
            lo, hi = min(steps) * 1e3, max(steps) * 1e3
            print(f"{link:<10} {case:<28} {med * 1e3:>9.1f} ms ({lo:.1f}-{hi:.1f}) {med / default:>10.3f}x")
    saved = {
        "command": "python experiments/benchmarks/bench_ddp_buckets.py " + " ".join(sys.argv[1:]),
        "repeats": args.repeats, "window": args.window, "table": table,
        "bench_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    args.out.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
