"""Which statistical range r per bits: the sweep behind `DEFAULT_STAT_RANGE` (muloco/compress/quantize.py).

Statistical quantization spreads its 2^bits bins over mean +- r x std of each row (r:
`compression.stat_range`; null picks r per bits). This sweeps r at 1, 2, 4 and 8 bits over three kinds of
rows, 1024 x 1024 fp32, row-wise, through the codec users run (encode + decode):

- gaussian: N(0, 1);
- outliers: Gaussian with ~0.1% of the entries x 20 (bench_compression.py's tensor, a heavy-tailed
  pseudogradient's stand-in);
- student_t4: Student-t with 4 degrees of freedom.

For each (bits, r, kind) it measures the relative MSE ||x - x_hat||^2 / ||x||^2, divides it by the best r's on
that kind, and calls the r whose worst ratio over the kinds is smallest the minimax choice. Deterministic
(seeded; no timing), a few seconds:

    python experiments/benchmarks/bench_stat_range.py     # -> results/bench_stat_range.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from muloco.compress import get_compressor
from muloco.compress.quantize import DEFAULT_STAT_RANGE

DEFAULT_OUT = Path(__file__).parent / "results" / "bench_stat_range.json"

# The r tried at each bit width: hivemind's 3 and the neighbours of the chosen value on both sides.
CANDIDATES = {
    8: [3.0, 4.0, 6.0, 10.0, 16.0, 24.0],
    4: [2.0, 2.5, 3.0, 3.75, 4.5, 6.0],
    2: [1.0, 1.5, 2.0, 2.5, 3.0],
    1: [0.5, 0.75, 1.0, 1.25, 1.5],
}


def make_rows(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """One of the three kinds of rows (see the module docstring), seeded."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=g)
    if kind == "outliers":
        x = torch.randn(rows, cols, generator=g)
        return torch.where(torch.rand(rows, cols, generator=g) < 1e-3, x * 20, x)
    if kind == "student_t4":
        # t_4 = Z / sqrt(chi2_4 / 4), chi2_4 = the sum of 4 squared standard normals.
        z = torch.randn(rows, cols, generator=g)
        chi2 = torch.randn(4, rows, cols, generator=g).pow(2).sum(0)
        return z / (chi2 / 4).sqrt()
    raise ValueError(f"unknown kind of rows {kind!r}")


KINDS = ("gaussian", "outliers", "student_t4")


def relative_mse(x: torch.Tensor, bits: int, r: float) -> float:
    codec = get_compressor("statistical", bits=bits, granularity="row", stat_range=r)
    x_hat = codec.decode(codec.encode(x))
    return float((x - x_hat).pow(2).sum() / x.pow(2).sum())


def sweep(rows: int, cols: int) -> dict:
    inputs = {kind: make_rows(kind, rows, cols) for kind in KINDS}
    out = {}
    for bits, rs in CANDIDATES.items():
        mse = {r: {kind: relative_mse(inputs[kind], bits, r) for kind in KINDS} for r in rs}
        best = {kind: min(m[kind] for m in mse.values()) for kind in KINDS}
        table = [
            {
                "r": r,
                **{kind: mse[r][kind] for kind in KINDS},
                "worst_ratio": max(mse[r][kind] / best[kind] for kind in KINDS),
            }
            for r in rs
        ]
        minimax = min(table, key=lambda row: row["worst_ratio"])
        default = next(row for row in table if row["r"] == DEFAULT_STAT_RANGE[bits])
        worst = [row["worst_ratio"] for row in table]
        out[str(bits)] = {
            "rows": table,
            "minimax_r": minimax["r"],
            "default_r": default["r"],
            # Ties within 0.1% count: at 1 bit r moves no split (the bins' centroids are their means).
            "default_is_minimax": default["worst_ratio"] <= minimax["worst_ratio"] * 1.001,
            "r_matters": max(worst) > min(worst) * 1.001,
        }
    return out


def print_table(results: dict) -> None:
    print(f"| bits | r | {' | '.join(KINDS)} | worst ratio to the best r |")
    print("|---:|---:|" + "---:|" * len(KINDS) + "---:|")
    for bits, res in results.items():
        for row in res["rows"]:
            mark = " (default)" if row["r"] == res["default_r"] else ""
            cells = " | ".join(f"{row[k]:.2e}" for k in KINDS)
            print(f"| {bits} | {row['r']:g}{mark} | {cells} | {row['worst_ratio']:.2f} |")
    for bits, res in results.items():
        verdict = "is" if res["default_is_minimax"] else "is NOT"
        note = "" if res["r_matters"] else " (r makes no difference at this width)"
        print(f"{bits} bits: the default r = {res['default_r']:g} {verdict} a minimax r{note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results = sweep(args.rows, args.cols)
    print_table(results)
    doc = {
        "benchmark": "bench_stat_range",
        "shape": [args.rows, args.cols],
        "granularity": "row",
        "metric": "relative MSE ||x - x_hat||^2 / ||x||^2 through encode + decode",
        "kinds": list(KINDS),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "bits": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
