"""Gram Newton-Schulz in bf16: how long may a block run before it restarts? (`GRAM_BLOCK`, muloco/optim).

Within a block the Gram variant updates only the small matrices Q and R (muloco/optim/orthogonalize.py);
rounding in R and Q compounds with every step of the block. This measures, on 256 x 1024 matrices (the
record's first measurement used 512 x 2048; bf16 matmuls without native CPU support make that minutes) with
six singular-value spectra (flat, 1/sqrt(i), 1/i, 1/i^2, rank 8, rank 1) and the three coefficient sets, the
relative error ||X - X_ref||_F / ||X_ref||_F of 5 bf16 steps against the same 5 steps in fp64 (the standard
iteration), for the standard bf16 iteration and for Gram blocks of 2, 3 and 5 (5: one block, no restart).
Deterministic (seeded; no timing), about a minute on 2 CPU cores:

    python experiments/benchmarks/bench_gram_block.py     # -> results/bench_gram_block.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch

from muloco.optim import orthogonalize as ns

DEFAULT_OUT = Path(__file__).parent / "results" / "bench_gram_block.json"
SPECTRA = ("flat", "inv_sqrt", "inv", "inv_sq", "rank8", "rank1")
BLOCKS = (2, 3, 5)
STEPS = 5
# Diverged: a relative error above 100% and above 10x the standard bf16 iteration's on the same input (on
# rank-1 inputs the standard bf16 iteration itself exceeds 100%: rounding noise in the null space grows).
DIVERGED, DIVERGED_OVER_STANDARD = 1.0, 10.0


def singular_values(kind: str, n: int) -> torch.Tensor:
    i = torch.arange(1, n + 1, dtype=torch.float64)
    if kind == "flat":
        return torch.ones(n, dtype=torch.float64)
    if kind == "inv_sqrt":
        return i.rsqrt()
    if kind == "inv":
        return 1 / i
    if kind == "inv_sq":
        return 1 / i**2
    if kind.startswith("rank"):
        rank = int(kind[4:])
        return (i <= rank).double()
    raise ValueError(f"unknown spectrum {kind!r}")


def make_matrix(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """U diag(s) V^T in fp64 with Haar-random U, V (QR of Gaussians) and the spectrum `kind`."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=torch.float64))
    return u @ torch.diag(singular_values(kind, rows)) @ v.T


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    err = float(torch.linalg.matrix_norm(x.double() - ref) / torch.linalg.matrix_norm(ref))
    return err if math.isfinite(err) else float("inf")


def run_case(g64: torch.Tensor, coeffs: str) -> dict:
    c = ns.resolve_coefficients(coeffs)
    schedule = c.schedule(STEPS)
    x64 = ns.normalize(g64, c.norm_scale)
    ref = ns.ns_iterate(x64, schedule, method="standard")
    x16 = x64.to(torch.bfloat16)
    out = {"standard": relative_error(ns.ns_iterate(x16, schedule, method="standard"), ref)}
    saved = ns.GRAM_BLOCK
    try:
        for block in BLOCKS:
            ns.GRAM_BLOCK = block  # the module reads it at each call
            out[f"gram_block_{block}"] = relative_error(ns.ns_iterate(x16, schedule, method="gram"), ref)
    finally:
        ns.GRAM_BLOCK = saved
    return out


def diverged(errors: dict, key: str) -> bool:
    return errors[key] > max(DIVERGED, DIVERGED_OVER_STANDARD * errors["standard"])


def summarize(cases: list[dict]) -> dict:
    """Per block: the largest excess over the standard bf16 error (percentage points) where it did not
    diverge, the worst error, and the cases that diverged."""
    out = {}
    for block in BLOCKS:
        key = f"gram_block_{block}"
        kept = [c for c in cases if not diverged(c["errors"], key)]
        excess = [100 * (c["errors"][key] - c["errors"]["standard"]) for c in kept]
        out[key] = {
            "max_excess_pp": max(excess) if excess else None,
            "worst_error": max(c["errors"][key] for c in cases),
            "diverged": [f"{c['coefficients']}/{c['spectrum']}" for c in cases if diverged(c["errors"], key)],
            "cases": len(cases),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    cases = []
    print(f"| coefficients | spectrum | standard bf16 | {' | '.join(f'Gram, block {b}' for b in BLOCKS)} |")
    print("|---|---|---:|" + "---:|" * len(BLOCKS))
    for spectrum in SPECTRA:
        g64 = make_matrix(spectrum, args.rows, args.cols)
        for coeffs in ns.COEFFICIENT_SETS:
            errors = run_case(g64, coeffs)
            cases.append({"coefficients": coeffs, "spectrum": spectrum, "errors": errors})
            cells = " | ".join(f"{v:.3g}" for v in errors.values())
            print(f"| {coeffs} | {spectrum} | {cells} |")
    summary = summarize(cases)
    for key, s in summary.items():
        excess = "n/a" if s["max_excess_pp"] is None else f"{s['max_excess_pp']:+.2f} pp"
        print(
            f"{key}: diverged on {len(s['diverged'])} of {len(cases)}; elsewhere at most {excess} over the "
            f"standard bf16 error; worst error {s['worst_error']:.3g}"
        )
    doc = {
        "benchmark": "bench_gram_block",
        "shape": [args.rows, args.cols],
        "steps": STEPS,
        "metric": "relative Frobenius error against the fp64 standard iteration",
        "gram_block_in_use": ns.GRAM_BLOCK,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cases": cases,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
