"""Throughput and error of every compression scheme, side by side with hivemind's 8-bit quantizers.

The input looks like a pseudogradient: a (16384, 1024) fp32 tensor (16M elements), Gaussian with ~0.1% of
the entries multiplied by 20 (outliers). For every scheme x bits x granularity, and for hivemind's
Uniform8BitQuantization and Quantile8BitQuantization (compress(tensor, info) / extract(serialized)), it
measures encode and decode throughput (GB/s of fp32 input), the relative error ||x - x_hat||^2 / ||x||^2 and
the bytes on the wire. Competitors are interleaved within each repetition; the table reports medians.

    python experiments/benchmarks/bench_compression.py                  # ~2-3 minutes on 2 CPU cores
    python experiments/benchmarks/bench_compression.py --rows 1024 --reps 1   # a quick look

Ours includes header validation and the CRC32 of the payload on both sides; hivemind's timing includes
building its protobuf message but not serializing it to bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
import zlib
from pathlib import Path

import torch

from muloco.compress import get_compressor

DEFAULT_OUT = Path(__file__).parent / "results" / "bench_compression.json"


def make_input(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with ~0.1% outliers x20 (a crude stand-in for a pseudogradient's heavy tail)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    outliers = torch.rand(rows, cols, generator=g) < 1e-3
    return torch.where(outliers, x * 20, x)


def ours() -> list[tuple[str, dict]]:
    cases = [("none", {"scheme": "none"}), ("bf16", {"scheme": "bf16"})]
    for scheme, extra in [
        ("statistical", {}),
        ("linear absmax", {"linear_mode": "absmax"}),
        ("linear minmax", {"linear_mode": "minmax"}),
    ]:
        for bits in (8, 4, 2, 1):
            for gran in ("row", "block", "tensor"):
                name = f"{scheme} {bits}b {gran}"
                cases.append(
                    (name, {"scheme": scheme.split()[0], "bits": bits, "granularity": gran, **extra})
                )
    for vb in (32, 16, 8):
        cases.append((f"topk 1% v{vb}", {"scheme": "topk", "topk_fraction": 0.01, "topk_value_bits": vb}))
    return cases


class Ours:
    def __init__(self, kwargs: dict):
        self.comp = get_compressor(**kwargs)

    def encode(self, x):
        return self.comp.encode(x)

    def decode(self, payload):
        return self.comp.decode(payload)

    @staticmethod
    def nbytes(payload) -> int:
        return len(payload)


class Hivemind:
    """hivemind.compression quantizers through their public compress / extract API."""

    def __init__(self, cls_name: str):
        import hivemind.compression as hc

        self.codec = getattr(hc, cls_name)()
        self.info_cls = hc.CompressionInfo

    def encode(self, x):
        return self.codec.compress(x, self.info_cls.from_tensor(x))

    def decode(self, msg):
        return self.codec.extract(msg)

    @staticmethod
    def nbytes(msg) -> int:
        return len(msg.buffer)


def competitors() -> list[tuple[str, object]]:
    out = [(name, Ours(kw)) for name, kw in ours()]
    try:
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")  # hivemind's deprecated op
        out += [
            ("hivemind Uniform8Bit", Hivemind("Uniform8BitQuantization")),
            ("hivemind Quantile8Bit", Hivemind("Quantile8BitQuantization")),
        ]
    except ImportError:
        print("hivemind is not installed: comparing our schemes only")
    return out


def measure(codec, x: torch.Tensor, error: bool) -> dict:
    t0 = time.perf_counter()
    payload = codec.encode(x)
    t1 = time.perf_counter()
    y = codec.decode(payload)
    t2 = time.perf_counter()
    out = {"encode_s": t1 - t0, "decode_s": t2 - t1, "nbytes": codec.nbytes(payload)}
    if error:  # deterministic: measured once, in fp64
        out["rel_mse"] = ((x.double() - y.double()).square().sum() / x.double().square().sum()).item()
    return out


def run(rows: int, cols: int, reps: int) -> dict:
    x = make_input(rows, cols)
    gb = x.numel() * 4 / 1e9
    cases = competitors()
    small = make_input(64, cols, seed=1)
    for _, codec in cases:  # warm-up: thread pools, lazy imports, first-call allocations
        measure(codec, small, error=False)
    runs: dict[str, list[dict]] = {name: [] for name, _ in cases}
    for rep in range(reps):
        order = cases if rep % 2 == 0 else cases[::-1]  # interleaved, alternating direction
        for name, codec in order:
            runs[name].append(measure(codec, x, error=rep == 0))
        print(f"repetition {rep + 1}/{reps} done", flush=True)
    results = {}
    for name, rs in runs.items():
        enc = statistics.median(r["encode_s"] for r in rs)
        dec = statistics.median(r["decode_s"] for r in rs)
        both = statistics.median(r["encode_s"] + r["decode_s"] for r in rs)
        results[name] = {
            "encode_GBps": gb / enc,
            "decode_GBps": gb / dec,
            "encode_decode_GBps": gb / both,
            "encode_ms": 1e3 * enc,
            "decode_ms": 1e3 * dec,
            "rel_mse": rs[0]["rel_mse"],
            "bits_per_param": 8 * rs[0]["nbytes"] / x.numel(),
            "reps": len(rs),
        }
    # What the CRC32 costs (computed once on encode and once on decode) for the 8-bit row payload.
    payload = get_compressor("statistical", 8).encode(x)
    t0 = time.perf_counter()
    for _ in range(5):
        zlib.crc32(payload)
    crc_ms = 1e3 * (time.perf_counter() - t0) / 5
    return {"results": results, "crc32_ms_8bit_payload": crc_ms}


def ratios(results: dict) -> dict:
    out = {}
    ref = results.get("hivemind Uniform8Bit")
    if ref is None:
        return out
    for name in ("statistical 8b row", "statistical 8b tensor", "linear absmax 8b row", "statistical 4b row"):
        ours_ = results[name]
        out[name] = {
            "throughput_ratio_vs_uniform8": ours_["encode_decode_GBps"] / ref["encode_decode_GBps"],
            "rel_mse_ratio_vs_uniform8": ours_["rel_mse"] / ref["rel_mse"],
        }
    return out


def table(results: dict) -> str:
    head = "| codec | bits/param | rel. MSE | encode GB/s | decode GB/s | enc+dec GB/s |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['bits_per_param']:.3f} | {r['rel_mse']:.2e} | {r['encode_GBps']:.2f} | "
            f"{r['decode_GBps']:.2f} | {r['encode_decode_GBps']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3, help="repetitions; the table reports medians")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = run(args.rows, args.cols, args.reps)
    out["ratios"] = ratios(out["results"])
    out["setup"] = {
        "shape": [args.rows, args.cols],
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(table(out["results"]))
    for name, r in out["ratios"].items():
        print(
            f"{name} vs hivemind Uniform8Bit: throughput x{r['throughput_ratio_vs_uniform8']:.2f}, "
            f"relative MSE x{r['rel_mse_ratio_vs_uniform8']:.3g}"
        )
    print(f"CRC32 of the 8-bit payload: {out['crc32_ms_8bit_payload']:.1f} ms (paid on encode and on decode)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} in {out['setup']['wall_s']} s")


if __name__ == "__main__":
    main()
