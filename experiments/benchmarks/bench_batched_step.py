"""The optimizer step that simulation.batched changes, alone: K replicas' inner optimizers stepped one
after another vs merged into one step (muloco/run/batched.py), on the same gradients.

Rounds interleave the two ways on fixed gradients (the work per step does not depend on the values); the
table reports the median ms per global step with the min-max spread, and the speed-up.

    python experiments/benchmarks/bench_batched_step.py [--k 8] [--preset nano] [--rounds 15] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muloco.config import InnerConfig, ModelConfig  # noqa: E402
from muloco.models import build_model  # noqa: E402
from muloco.optim import build_inner_optimizer  # noqa: E402
from muloco.run.batched import step_together  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_batched_step.json"


def replicas(k: int, preset: str, inner: str, device: torch.device):
    torch.manual_seed(0)
    out = []
    for _ in range(k):
        model = build_model(ModelConfig(preset=preset), 256).to(device)
        optimizer = build_inner_optimizer(model, InnerConfig(optimizer=inner))
        grads = [torch.randn_like(p) for p in model.parameters()]
        out.append((model, optimizer, grads))
    return out


def time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    print(
        f"\none inner optimizer step of K={args.k} replicas, preset={args.preset}, {device}, "
        f"{args.rounds} rounds"
    )
    print(f"{'inner':<8}{'one by one ms':>15}{'spread':>16}{'batched ms':>12}{'spread':>16}{'speed-up':>10}")
    for inner in ("muon", "adamw"):
        reps = replicas(args.k, args.preset, inner, device)

        def set_grads(reps=reps):
            for model, _, grads in reps:
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = g.clone()

        def one_by_one(reps=reps):
            for _, optimizer, _ in reps:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        def batched(reps=reps):
            step_together([optimizer for _, optimizer, _ in reps])

        times = {"one by one": [], "batched": []}
        for round_index in range(args.rounds + 1):  # round 0 warms up (and creates the state)
            for name, fn in (("one by one", one_by_one), ("batched", batched)):
                set_grads()
                ms = time_ms(fn, device)
                if round_index > 0:
                    times[name].append(ms)
        seq, bat = (statistics.median(times[n]) for n in ("one by one", "batched"))
        speedups = [a / b for a, b in zip(times["one by one"], times["batched"], strict=True)]
        row = {
            "inner": inner,
            "one_by_one_ms": round(seq, 2),
            "batched_ms": round(bat, 2),
            "speedup_median": round(statistics.median(speedups), 3),
            "speedup_min": round(min(speedups), 3),
            "speedup_max": round(max(speedups), 3),
            "raw": times,
        }
        rows.append(row)
        s1 = f"{min(times['one by one']):.1f}-{max(times['one by one']):.1f}"
        s2 = f"{min(times['batched']):.1f}-{max(times['batched']):.1f}"
        print(f"{inner:<8}{seq:>15.1f}{s1:>16}{bat:>12.1f}{s2:>16}{row['speedup_median']:>9.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
