"""Chunked top-k (SparseLoCo's codec) on a 1B-entry pseudogradient: encode + decode time, bytes, error.

A 1B-parameter model's pseudogradient, as `--tensors` matrices of 4096 x 4096 (64 by default: 1.07B
entries), each Gaussian with ~0.1% of its entries x 20 (bench_compression.py's stand-in), generated one at a
time (a 4 GB fp32 whole would not leave room for the copies). Every codec encodes and decodes each matrix in
turn, the codecs interleaved per matrix and the whole pass repeated (`--repeats`); the table gives the
median seconds per GB of fp32 and GB/s per core (the torch threads the codec ran on), with the spread over
the repeats, the bytes on the wire (x fewer than fp32) and the relative error ||x - x_hat||^2 / ||x||^2.

It also compares, on the first matrix's kept values (3.125% of every 64 x 64 tile), our statistical
quantizer with the bins of SparseLoCo's code (tplr/sparseloco.py: mean-shifted, step 6 sigma / 2^bits, code
round(c / step + 2^(bits-1)) clamped, each code decoded to its bin's mean): relative MSE at 2 and 4 bits.

    python experiments/benchmarks/bench_topk_chunked.py                 # ~10 min on 2 cores
    python experiments/benchmarks/bench_topk_chunked.py --tensors 4 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from muloco.compress import get_compressor
from muloco.compress.chunks import kept_per_chunk, tiling
from muloco.compress.quantize import dequantize_codes, quantize
from muloco.compress.topk import select_chunked

DEFAULT_OUT = Path(__file__).parent / "results" / "bench_topk_chunked.json"
SHAPE = (4096, 4096)
CODECS = {
    # SparseLoCo's: 128 of every 64 x 64 tile at 2 bits (arXiv 2508.15706), and the study's other points
    "chunked 3.125% 2-bit": {
        "scheme": "topk",
        "topk_chunk": 4096,
        "topk_fraction": 0.03125,
        "topk_value_bits": 2,
    },
    "chunked 3.125% 4-bit": {
        "scheme": "topk",
        "topk_chunk": 4096,
        "topk_fraction": 0.03125,
        "topk_value_bits": 4,
    },
    "chunked 1.5% 2-bit": {
        "scheme": "topk",
        "topk_chunk": 4096,
        "topk_fraction": 0.015,
        "topk_value_bits": 2,
    },
    "chunked 0.5% 2-bit": {
        "scheme": "topk",
        "topk_chunk": 4096,
        "topk_fraction": 0.005,
        "topk_value_bits": 2,
    },
    # for comparison: top-k of the whole tensor (delta-coded indices), and the 4-bit quantizer MuLoCo sends
    "per-tensor 3.125% 8-bit": {"scheme": "topk", "topk_fraction": 0.03125, "topk_value_bits": 8},
    "statistical 4-bit row": {"scheme": "statistical", "bits": 4, "granularity": "row"},
}


def make_matrix(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g)
    return torch.where(torch.rand(SHAPE, generator=g) < 1e-3, x * 20, x)


def one_pass(codecs: dict, tensors: int) -> dict:
    """Seconds (encode, decode), bytes and squared errors of every codec over `tensors` matrices."""
    out = {name: {"encode_s": 0.0, "decode_s": 0.0, "bytes": 0, "err": 0.0, "norm": 0.0} for name in codecs}
    for seed in range(tensors):
        x = make_matrix(seed)
        for name, comp in codecs.items():
            t0 = time.perf_counter()
            payload = comp.encode(x)
            t1 = time.perf_counter()
            y = comp.decode(payload)
            t2 = time.perf_counter()
            o = out[name]
            o["encode_s"] += t1 - t0
            o["decode_s"] += t2 - t1
            o["bytes"] += len(payload)
            o["err"] += float((x - y).pow(2).sum())
            o["norm"] += float(x.pow(2).sum())
    return out


def reference_bins(v: torch.Tensor, bits: int) -> torch.Tensor:
    """SparseLoCo's value quantizer (its code's, as the module docstring says), decoded."""
    levels = 2**bits
    c = v - v.mean()
    step = 6 * (c.norm() / (c.numel() - 1) ** 0.5) / levels
    code = torch.clamp(torch.round(c / step + levels // 2), 0, levels - 1).long()
    sums = torch.zeros(levels).index_add_(0, code, c)
    lut = sums / torch.bincount(code, minlength=levels).clamp(min=1)
    return lut[code] + v.mean()


def kept_value_error() -> dict:
    """Relative MSE of the kept values at 2 and 4 bits: ours against the reference's bins."""
    x = make_matrix(0)
    t = tiling(SHAPE, 64)
    v = select_chunked(x, t, kept_per_chunk(t.chunk_len, 0.03125))[1].reshape(-1).contiguous()
    out = {}
    for bits in (2, 4):
        ours = dequantize_codes(quantize(v, bits, "statistical", "tensor"), bits, (v.numel(),), "tensor", 1)
        theirs = reference_bins(v, bits)
        mse = [float((y - v).pow(2).sum() / v.pow(2).sum()) for y in (ours, theirs)]
        out[str(bits)] = {"ours": mse[0], "reference": mse[1], "ours_over_reference": mse[0] / mse[1]}
    return out


def summarize(passes: list[dict], tensors: int, threads: int) -> dict:
    gb = tensors * SHAPE[0] * SHAPE[1] * 4 / 1e9
    rows = {}
    for name in passes[0]:
        total = [p[name]["encode_s"] + p[name]["decode_s"] for p in passes]
        first = passes[0][name]
        rows[name] = {
            "s_per_gb": statistics.median(total) / gb,
            "s_per_gb_range": [min(total) / gb, max(total) / gb],
            "encode_s_per_gb": statistics.median(p[name]["encode_s"] for p in passes) / gb,
            "decode_s_per_gb": statistics.median(p[name]["decode_s"] for p in passes) / gb,
            "gb_per_s_per_core": gb / statistics.median(total) / threads,
            "bytes": first["bytes"],
            "x_fewer_than_fp32": gb * 1e9 / first["bytes"],
            "bits_per_entry": 8 * first["bytes"] / (gb * 1e9 / 4),
            "relative_error": first["err"] / first["norm"],
        }
    return rows


def table(rows: dict, entries: int) -> str:
    lines = [
        f"{entries / 1e9:.2f}B entries (fp32 {entries * 4 / 1e9:.1f} GB); median over repeats (min-max)",
        f"{'codec':<26} {'s / GB (enc+dec)':>22} {'GB/s/core':>10} {'bits/entry':>11} {'x fewer':>8} "
        f"{'rel err':>8}",
    ]
    for name, r in rows.items():
        lo, hi = r["s_per_gb_range"]
        lines.append(
            f"{name:<26} {r['s_per_gb']:>8.2f} ({lo:.2f}-{hi:.2f}){'':>3} {r['gb_per_s_per_core']:>10.3f} "
            f"{r['bits_per_entry']:>11.3f} {r['x_fewer_than_fp32']:>8.1f} {r['relative_error']:>8.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=64, help="4096 x 4096 matrices (64: 1.07B entries)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    codecs = {name: get_compressor(**kw) for name, kw in CODECS.items()}
    threads = torch.get_num_threads()
    started = time.perf_counter()
    passes = [one_pass(codecs, args.tensors) for _ in range(args.repeats)]
    rows = summarize(passes, args.tensors, threads)
    entries = args.tensors * SHAPE[0] * SHAPE[1]
    print(table(rows, entries))
    values = kept_value_error()
    for bits, v in values.items():
        print(
            f"kept values at {bits} bits, relative MSE: ours {v['ours']:.4f}, SparseLoCo's bins "
            f"{v['reference']:.4f} ({v['ours_over_reference']:.2f}x)"
        )
    result = {
        "command": "python experiments/benchmarks/bench_topk_chunked.py "
        + f"--tensors {args.tensors} --repeats {args.repeats}",
        "entries": entries,
        "shape": list(SHAPE),
        "threads": threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "codecs": CODECS,
        "rows": rows,
        "kept_value_error": values,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
