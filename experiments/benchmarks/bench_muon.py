"""One Muon step on the hidden matrices of the `medium` GPT: our Muon vs torch.optim.Muon vs AdamW.

The 24 matrices of build_model(ModelConfig(preset="medium"), 256) (6 x qkv 1536x512, proj 512x512,
fc 2048x512, mlp.proj 512x2048; 18.9M parameters) get fixed random gradients. The optimizers step in
turn (round-robin: ours; ours with the standard iteration; ours with muloco coefficients and 4 steps;
torch.optim.Muon; AdamW; repeated), so load from other processes hits all of them alike; the table
reports the median step time after warm-up.
It also reports the orthogonality of each coefficient set's Newton-Schulz output on those shapes and
the optimizer-state bytes of Muon vs AdamW.

    python experiments/benchmarks/bench_muon.py [--device cpu|cuda] [--steps 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from muloco.config import ModelConfig  # noqa: E402
from muloco.models import ParamRole, build_model, param_roles  # noqa: E402
from muloco.optim import Muon, newton_schulz  # noqa: E402
from muloco.optim.orthogonalize import GRAM_BLOCK, KELLER, default_ns_dtype, uses_gram  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_muon.json"


def matrices(device: torch.device, shape: dict | None = None) -> list[torch.Tensor]:
    """The hidden matrices of the `medium` GPT, or of the preset/size in `shape` (ModelConfig fields)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**(shape or {"preset": "medium"})), 256)
    roles = param_roles(model)
    return [p.detach().to(device) for name, p in model.named_parameters() if roles[name] is ParamRole.MATRIX]


def ns_gflop(shape: torch.Size, steps: int, gram: bool) -> float:
    """Matmul GFLOP of one Newton-Schulz call on an (n, m) matrix, n <= m (2 flops per multiply-add)."""
    n, m = sorted(shape)
    big, small = 2 * n * n * m, 2 * n**3  # an (n,m)x(m,n) or (n,n)x(n,m) product; an (n,n)x(n,n) product
    if not gram:
        return steps * (2 * big + small) / 1e9
    total = 0
    for start in range(0, steps, GRAM_BLOCK):
        k = min(GRAM_BLOCK, steps - start)  # R = X X^T and X <- Q X, k Z's, k-1 Q Z's, k-1 (Z R) Z's
        total += 2 * big + (k + (k - 1) + 2 * (k - 1)) * small
    return total / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_round_robin(
    steppers: dict[str, Callable[[], None]], device: torch.device, steps: int, warmup: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for i in range(warmup + steps):
        for name, step in steppers.items():
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def orthogonality(outputs: list[torch.Tensor]) -> dict[str, float]:
    """How far the NS outputs' singular values are from 1.

    Rectangular (3:1, 4:1) and square (512 x 512) matrices are reported apart: a random square matrix has
    singular values down to ~1/n, which no 5-step iteration lifts, so its max |sigma - 1| is ~1 for
    every method. gram_error = ||X X^T - I||_F / sqrt(n) (n the short side) = sqrt(mean((sigma^2 - 1)^2)).
    """
    rect = [torch.linalg.svdvals(x.float().cpu()) for x in outputs if x.shape[-1] != x.shape[-2]]
    square = [torch.linalg.svdvals(x.float().cpu()) for x in outputs if x.shape[-1] == x.shape[-2]]
    every = rect + square
    return {
        "max_abs_sigma_minus_1_rect": max((s - 1).abs().max().item() for s in rect),
        "mean_abs_sigma_minus_1_rect": torch.cat([(s - 1).abs() for s in rect]).mean().item(),
        "max_abs_sigma_minus_1_square": max((s - 1).abs().max().item() for s in square),
        "mean_abs_sigma_minus_1_square": torch.cat([(s - 1).abs() for s in square]).mean().item(),
        "gram_error": statistics.mean(((s**2 - 1) ** 2).mean().sqrt().item() for s in every),
        "sigma_min_rect": min(s.min().item() for s in rect),
        "sigma_max": max(s.max().item() for s in every),
    }


def matmul_gflops(device: torch.device, dtype: torch.dtype, repeats: int = 7) -> float:
    """Throughput of the Newton-Schulz workhorse, X @ X^T for a 512 x 2048 X: the bf16-vs-fp32 choice."""
    X = torch.randn(512, 2048, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        X @ X.T
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * 512 * 512 * 2048 / statistics.median(times[1:]) / 1e9


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (bf16 Newton-Schulz)")
    parser.add_argument("--steps", type=int, default=7, help="measured steps per optimizer (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    parser.add_argument("--d-model", type=int, help="another model width (e.g. 1024 with --n-layers 12)")
    parser.add_argument("--n-layers", type=int, help="another depth, with --d-model")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")

    shape = None
    if args.d_model:  # heads of 64 dims, as the presets
        shape = {"preset": "medium", "d_model": args.d_model, "n_heads": max(1, args.d_model // 64)}
        shape["n_layers"] = args.n_layers or 6
    base = matrices(device, shape)
    gen = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen, device=device) for p in base]
    dtype = default_ns_dtype(device)
    size = sum(p.numel() for p in base) / 1e6
    print(f"{len(base)} matrices, {size:.1f}M parameters on {device}; NS dtype {dtype}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    def make(build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        params = [torch.nn.Parameter(p.clone()) for p in base]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        return build(params)

    # Same hyperparameters everywhere (config defaults, adjust_lr as torch's default): only speed differs.
    kw = dict(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5)
    optimizers = {
        "ours keller 5 (auto: Gram on 3:1, 4:1)": make(lambda ps: Muon(ps, **kw, adjust_lr="original")),
        "ours keller 5 (standard NS)": make(
            lambda ps: Muon(ps, **kw, adjust_lr="original", ns_method="standard")
        ),
        "ours muloco 4 (auto)": make(
            lambda ps: Muon(ps, **{**kw, "ns_steps": 4}, ns_coefficients="muloco", adjust_lr="original")
        ),
        "torch.optim.Muon (keller 5)": make(lambda ps: torch.optim.Muon(ps, **kw, adjust_lr_fn="original")),
        "torch.optim.AdamW": make(lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95))),
    }
    times = time_round_robin({n: o.step for n, o in optimizers.items()}, device, args.steps, args.warmup)
    median = {name: statistics.median(t) for name, t in times.items()}
    ours, ours_std, ours_short, torch_muon, adamw = (median[n] for n in optimizers)

    flops = {
        "ours keller 5 auto": sum(ns_gflop(p.shape, 5, uses_gram(*p.shape)) for p in base),
        "ours muloco 4 auto": sum(ns_gflop(p.shape, 4, uses_gram(*p.shape)) for p in base),
        "standard (ours standard, torch)": sum(ns_gflop(p.shape, 5, False) for p in base),
    }

    # Orthogonality of the Newton-Schulz output per coefficient set on a fresh random gradient per matrix.
    from torch.optim._muon import _zeropower_via_newtonschulz  # torch's NS, bf16 on every device

    probe = [torch.randn(p.shape, generator=gen, device=device) for p in base]
    ortho = {
        "torch.optim.Muon (keller, bf16)": orthogonality(
            [_zeropower_via_newtonschulz(g, KELLER.triples[0], 5, 1e-7) for g in probe]
        )
    }
    for name, steps, method in [
        ("keller", 5, "auto"),
        ("keller", 5, "standard"),
        ("muloco", 4, "auto"),
        ("muloco", 5, "auto"),
        ("muloco", 5, "standard"),
        ("polar_express", 5, "auto"),
        ("polar_express", 5, "standard"),
    ]:
        outputs = [newton_schulz(g, name, steps, method=method) for g in probe]
        ortho[f"ours {name} {steps} ({method})"] = orthogonality(outputs)

    gflops = {str(dt): matmul_gflops(device, dt) for dt in (torch.float32, torch.bfloat16)}

    muon_bytes = state_bytes(optimizers["ours keller 5 (auto: Gram on 3:1, 4:1)"])
    adamw_bytes = state_bytes(optimizers["torch.optim.AdamW"])

    print(f"\n{'optimizer step':<40} {'median ms':>10} {'min ms':>8} {'vs torch Muon':>14}")
    for name, t in times.items():
        print(f"{name:<40} {median[name]:>10.1f} {min(t):>8.1f} {median[name] / torch_muon:>13.2f}x")
    print("\nmatmul 512x2048 @ 2048x512 GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in gflops.items()))
    print("NS matmul GFLOP per step: " + ", ".join(f"{k} {v:.0f}" for k, v in flops.items()))
    header = f"{'rect: max|s-1|':>14} {'mean|s-1|':>10} {'square: mean|s-1|':>18} {'XX^T-I':>7}"
    print(f"\n{'NS output':<34} {header}")
    for name, o in ortho.items():
        print(
            f"{name:<34} {o['max_abs_sigma_minus_1_rect']:>14.3f} {o['mean_abs_sigma_minus_1_rect']:>10.3f} "
            f"{o['mean_abs_sigma_minus_1_square']:>18.3f} {o['gram_error']:>7.3f}"
        )
    print(
        f"\nstate bytes: Muon {muon_bytes / 2**20:.1f} MiB, AdamW {adamw_bytes / 2**20:.1f} MiB "
        f"({muon_bytes / adamw_bytes:.3f}x)"
    )
    ratio = ours / torch_muon
    verdict = "met" if ratio <= 0.8 else "missed"
    print(
        f"ours keller 5 / torch.optim.Muon = {ratio:.2f} (target <= 0.80: {verdict}); "
        f"ours muloco 4 / torch = {ours_short / torch_muon:.2f}; ours keller 5 / AdamW = {ours / adamw:.2f}"
    )

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "ns_dtype": str(default_ns_dtype(device)),
        "matrices": len(base),
        "matrix_params": sum(p.numel() for p in base),
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": {name: {"median": median[name], "all": t} for name, t in times.items()},
        "ratios": {
            "ours_over_torch_muon": ratio,
            "ours_standard_over_torch_muon": ours_std / torch_muon,
            "ours_muloco4_over_torch_muon": ours_short / torch_muon,
            "ours_over_adamw": ours / adamw,
            "muon_state_over_adamw_state": muon_bytes / adamw_bytes,
        },
        "ns_gflop_per_step": flops,
        "matmul_gflops": gflops,
        "orthogonality": ortho,
        "state_bytes": {"muon": muon_bytes, "adamw": adamw_bytes},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
