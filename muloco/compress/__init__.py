"""Compression of pseudogradients: quantizers, top-k, error feedback, and a validated wire format.

Map of the package (arrows point down only):
    factory.py         get_compressor, get_compressor_from_config, decode(any payload); imports every scheme
      -> plain.py      schemes none (fp32, exact) and bf16
      -> linear.py     scheme linear (absmax / minmax)          } both GroupQuantizers (group.py):
      -> statistical.py scheme statistical (centroid table)     } quantize.py's codes + per-group stats
      -> topk.py       scheme topk: pure top-k functions (selection, delta-coded indices) and TopK
        -> chunks.py   chunked top-k's tiles (SparseLoCo): geometry, k per chunk, to / from chunks
    error_feedback.py  ErrorFeedback: per-replica residuals, e = decay * e + delta; e -= alpha * deQ(Q(e))
    base.py            Compressor (encode / decode_sections), register_scheme, scheme_class, shared helpers
      -> quantize.py   pure functions: group statistics, codes, lookup tables, dequantization
      -> packing.py    pure functions: dense bit packing of 1/2/4/8-bit codes and n-bit integers
      -> wire.py       header layout, body sections, CRC32; `parse` validates everything before decoding
      -> errors.py     CompressionError (a ValueError)
The allowed widths (QUANT_BITS, TOPK_VALUE_BITS) are the config's: muloco/config/bits.py.

A new scheme: a Compressor subclass with `@register_scheme` (its name needs a wire code in wire.SCHEMES),
imported by factory.py. Names are loaded lazily: `import muloco.compress` alone does not import torch.

Usage (docs/compression.md has the details and the wire format table):

    from muloco.compress import get_compressor
    comp = get_compressor("statistical", bits=4, granularity="row")
    payload = comp.encode(delta)          # bytes
    delta_hat = comp.decode(payload)      # fp32 CPU tensor, delta's shape; CompressionError if malformed
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from muloco.compress.base import Compressor, register_scheme
    from muloco.compress.error_feedback import ErrorFeedback
    from muloco.compress.errors import CompressionError
    from muloco.compress.factory import (
        decode,
        get_compressor,
        get_compressor_from_config,
        registered_schemes,
    )
    from muloco.compress.linear import LinearQuantizer
    from muloco.compress.plain import BF16Compression, NoCompression
    from muloco.compress.quantize import DEFAULT_STAT_RANGE
    from muloco.compress.statistical import StatisticalQuantizer
    from muloco.compress.topk import TopK
    from muloco.compress.wire import Header, read_header

# Public name -> the module that defines it. `registered_schemes` comes through factory, whose import
# registers every scheme.
_EXPORTS = {
    "BF16Compression": "plain",
    "CompressionError": "errors",
    "Compressor": "base",
    "DEFAULT_STAT_RANGE": "quantize",
    "ErrorFeedback": "error_feedback",
    "Header": "wire",
    "LinearQuantizer": "linear",
    "NoCompression": "plain",
    "StatisticalQuantizer": "statistical",
    "TopK": "topk",
    "decode": "factory",
    "get_compressor": "factory",
    "get_compressor_from_config": "factory",
    "read_header": "wire",
    "register_scheme": "base",
    "registered_schemes": "factory",
}


def __getattr__(name: str):
    # Lazy: torch is imported with the first scheme a caller asks for, not with the package.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'muloco.compress' has no attribute {name!r}")
    return getattr(importlib.import_module(f"muloco.compress.{module}"), name)


__all__ = [
    "BF16Compression",
    "CompressionError",
    "Compressor",
    "DEFAULT_STAT_RANGE",
    "ErrorFeedback",
    "Header",
    "LinearQuantizer",
    "NoCompression",
    "StatisticalQuantizer",
    "TopK",
    "decode",
    "get_compressor",
    "get_compressor_from_config",
    "read_header",
    "register_scheme",
    "registered_schemes",
]
