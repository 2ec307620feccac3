"""What each sync.aggregate rule costs in time: combining K contributions shaped like the `small` GPT's
pseudogradient (10.9M parameters, fp32, CPU), each rule beside the mean in one run, interleaved repeats;
and what a swarm peer's consistency check costs per sync: the digest of its state (global parameters and
outer momentum) that it announces (muloco.comm.digest.state_digest).

    python experiments/benchmarks/bench_aggregate.py --ks 4 8 --reps 5

Prints a table (median seconds, spread, ratio to the mean at the same K) and writes
experiments/benchmarks/results/bench_aggregate.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from muloco.comm.aggregate import AGGREGATES, aggregate
from muloco.comm.digest import state_digest
from muloco.config import load_config
from muloco.models import build_model

OUT = Path(__file__).parent / "results" / "bench_aggregate.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build_model(load_config(None, [f"model.preset={args.preset}"]).model, 256)
    shapes = [p.shape for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    rows = []
    for K in args.ks:
        members = [[torch.randn(s) * 1e-3 for s in shapes] for _ in range(K)]
        seconds: dict[str, list[float]] = {rule: [] for rule in AGGREGATES}
        for _ in range(args.reps):  # interleaved: every rule once per repeat
            for rule in AGGREGATES:
                t0 = time.perf_counter()
                aggregate(members, rule, trim=1)
                seconds[rule].append(time.perf_counter() - t0)
        base = statistics.median(seconds["mean"])
        for rule in AGGREGATES:
            median = statistics.median(seconds[rule])
            rows.append(
                {
                    "workers": K,
                    "rule": rule,
                    "median_s": median,
                    "min_s": min(seconds[rule]),
                    "max_s": max(seconds[rule]),
                    "vs_mean": median / base,
                    "params": numel,
                }
            )
    state = [torch.randn(s) for s in shapes] * 2  # global parameters + outer momentum
    digest_s = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        state_digest(state)
        digest_s.append(time.perf_counter() - t0)
    digest = {"median_s": statistics.median(digest_s), "min_s": min(digest_s), "max_s": max(digest_s)}
    print(
        f"{numel / 1e6:.1f}M parameters, {args.reps} interleaved repeats, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'K':>3} {'rule':<14} {'median s':>9} {'min-max s':>15} {'vs mean':>8}")
    for r in rows:
        spread = f"{r['min_s']:.3f}-{r['max_s']:.3f}"
        print(f"{r['workers']:>3} {r['rule']:<14} {r['median_s']:>9.3f} {spread:>15} {r['vs_mean']:>7.1f}x")
    spread = f"{digest['min_s']:.3f}-{digest['max_s']:.3f}"
    print(f"state digest (2 x {numel / 1e6:.1f}M fp32): {digest['median_s']:.3f} s median ({spread})")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = {"reps": args.reps, "preset": args.preset, "rows": rows, "state_digest": digest}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
