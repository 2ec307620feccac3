"""Forward/backward of K small replicas: one after another, all in one vmap(grad(functional_call)) call,
or (the bound) one model on the union of their batches, as DP computes it.

simulation.batched steps the optimizers of all replicas together (muloco/run/batched.py); whether their
forward/backward should also be one call is this benchmark's question, per device. Rounds interleave the
three ways; the table reports the median ms per step with the min-max spread.

    python experiments/benchmarks/bench_batched_forward.py [--device cpu|cuda] [--k 8] [--seqs 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muloco.config import ModelConfig  # noqa: E402
from muloco.models import build_model  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_batched_forward.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--k", type=int, default=8, help="replicas")
    parser.add_argument("--seqs", type=int, default=4, help="sequences of 128 per replica")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per way per round")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    device, K, B, T = torch.device(args.device), args.k, args.seqs, 128
    torch.manual_seed(0)
    cfg = ModelConfig(preset=args.preset, seq_len=T)
    replicas = [build_model(cfg, 256).to(device) for _ in range(K)]
    union = build_model(cfg, 256).to(device)
    skeleton = build_model(cfg, 256).to("meta")
    x = torch.randint(0, 256, (K, B, T), device=device)
    y = torch.randint(0, 256, (K, B, T), device=device)

    def one_after_another() -> None:
        for k, model in enumerate(replicas):
            model(x[k], y[k]).backward()

    batched = vmap(grad_and_value(lambda params, xs, ys: functional_call(skeleton, params, (xs, ys))))

    def vmap_one_call() -> None:
        params, _ = stack_module_state(replicas)  # what a step would pay to stack the replicas' weights
        grads, _ = batched(params, x, y)
        for k, model in enumerate(replicas):  # and to hand each replica its gradients
            for name, p in model.named_parameters():
                p.grad = grads[name][k]

    def dp_union_batch() -> None:
        union(x.view(K * B, T), y.view(K * B, T)).backward()

    ways = {
        "one after another": one_after_another,
        "vmap, one call": vmap_one_call,
        "DP, union batch": dp_union_batch,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's "no batching rule for SDPA, falling back" warning
        for fn in ways.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, fn in ways.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) / args.steps * 1000)
    loop = statistics.median(times["one after another"])
    print(f"\nforward/backward of K={K} replicas x {B} sequences of {T}, preset={args.preset}, {device}")
    print(f"{'way':<20}{'ms/step':>10}{'spread':>16}{'vs loop':>9}")
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"way": name, "ms": round(med, 2), "min": round(min(t), 2), "max": round(max(t), 2)})
        print(f"{name:<20}{med:>10.1f}{f'{min(t):.1f}-{max(t):.1f}':>16}{loop / med:>8.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
