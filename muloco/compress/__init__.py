"""Compression of pseudogradients: quantizers, top-k, error feedback, and a validated wire format.

Map of the package (arrows point down only):
    compressors.py     Compressor classes (none, bf16, linear, statistical, topk), get_compressor,
                       get_compressor_from_config, decode(any payload)
    error_feedback.py  ErrorFeedback: per-replica residuals, e = decay * e + delta; e -= alpha * deQ(Q(e))
      -> quantize.py   pure functions: group statistics, codes, lookup tables, dequantization
      -> topk.py       pure functions: top-k selection, delta-coded indices
      -> packing.py    pure functions: dense bit packing of 1/2/4/8-bit codes and n-bit integers
      -> wire.py       header layout, body sections, CRC32; `parse` validates everything before decoding
      -> errors.py     CompressionError (a ValueError)

Usage (docs/compression.md has the details and the wire format table):

    from muloco.compress import get_compressor
    comp = get_compressor("statistical", bits=4, granularity="row")
    payload = comp.encode(delta)          # bytes
    delta_hat = comp.decode(payload)      # fp32 CPU tensor, delta's shape; CompressionError if malformed
"""

from muloco.compress.compressors import (
    BF16Compression,
    Compressor,
    LinearQuantizer,
    NoCompression,
    StatisticalQuantizer,
    TopK,
    decode,
    get_compressor,
    get_compressor_from_config,
)
from muloco.compress.error_feedback import ErrorFeedback
from muloco.compress.errors import CompressionError
from muloco.compress.quantize import DEFAULT_STAT_RANGE
from muloco.compress.wire import Header, read_header

__all__ = [
    "DEFAULT_STAT_RANGE",
    "BF16Compression",
    "CompressionError",
    "Compressor",
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
]
