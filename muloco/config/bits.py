"""The allowed bit widths, defined once with the schema: CompressionConfig checks against them and the
compressors (muloco/compress/) import them from here. Imports nothing (no torch), so that loading a config
stays fast."""

from __future__ import annotations

# Codes of the linear and statistical quantizers: the widths that pack densely into a byte (packing.py).
QUANT_BITS = (1, 2, 4, 8)
# Kept top-k values: fp32, bf16, or 8-bit linear absmax with one bf16 step per tensor.
TOPK_VALUE_BITS = (8, 16, 32)


def one_of(choices: tuple) -> str:
    """'1, 2, 4 or 8': the choices as an error message lists them."""
    *head, last = map(str, choices)
    return f"{', '.join(head)} or {last}" if head else last
