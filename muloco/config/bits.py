"""The allowed bit widths, defined once with the schema: CompressionConfig checks against them and the
compressors (muloco/compress/) import them from here. Imports nothing (no torch), so that loading a config
stays fast."""

from __future__ import annotations

import math

# Codes of the linear and statistical quantizers: the widths that pack densely into a byte (packing.py).
QUANT_BITS = (1, 2, 4, 8)
# Kept top-k values: fp32, bf16, 8-bit linear absmax with one bf16 step per tensor, or 4 / 2-bit
# statistical over the tensor's kept values (SparseLoCo's 2-bit values, arXiv 2508.15706).
TOPK_VALUE_BITS = (2, 4, 8, 16, 32)


def one_of(choices: tuple) -> str:
    """'1, 2, 4 or 8': the choices as an error message lists them."""
    *head, last = map(str, choices)
    return f"{', '.join(head)} or {last}" if head else last


def check_chunk(chunk) -> int | None:
    """compression.topk_chunk: None (top-k per tensor) or a square number of entries; returns the side of
    its tiles (64 for 4,096), ValueError otherwise."""
    if chunk is None:
        return None
    side = math.isqrt(chunk) if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0 else 0
    if side == 0 or side * side != chunk or side >= 1 << 16:
        raise ValueError(
            f"topk_chunk must be a square number of entries below 2**32 (64 x 64 = 4096: square tiles of "
            f"matrices, runs of 64 in vectors), or unset for per-tensor top-k; got {chunk!r}"
        )
    return side
