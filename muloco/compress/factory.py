"""get_compressor / get_compressor_from_config, and `decode` for a payload of any scheme.

Importing this module registers every scheme (the imports below); lookups go through base's registry.
"""

from __future__ import annotations

import torch

from muloco.compress import linear, plain, statistical, topk  # noqa: F401  (register the schemes)
from muloco.compress.base import (
    Compressor,
    check_block_size,
    check_choice,
    registered_schemes,
    scheme_class,
    split_body,
)
from muloco.compress.quantize import GRANULARITIES, LINEAR_MODES
from muloco.compress.statistical import check_stat_range
from muloco.compress.topk import check_fraction
from muloco.compress.wire import parse
from muloco.config.bits import QUANT_BITS, TOPK_VALUE_BITS, check_chunk


def get_compressor(
    scheme: str,
    bits: int = 8,
    granularity: str = "row",
    block_size: int = 256,
    linear_mode: str = "absmax",
    stat_range: float | None = None,
    topk_fraction: float = 0.01,
    topk_value_bits: int = 32,
    topk_chunk: int | None = None,
) -> Compressor:
    """The compressor for `scheme` (none | bf16 | linear | statistical | topk). Arguments a scheme does not
    use are still validated (a typo should not pass silently). Bad arguments raise ValueError naming them."""
    check_choice("scheme", scheme, registered_schemes())
    check_choice("bits", bits, QUANT_BITS)
    check_choice("granularity", granularity, GRANULARITIES)
    check_choice("linear_mode", linear_mode, LINEAR_MODES)
    check_choice("topk_value_bits", topk_value_bits, TOPK_VALUE_BITS)
    check_block_size(block_size)
    check_stat_range(stat_range)
    check_fraction(topk_fraction)
    check_chunk(topk_chunk)
    return scheme_class(scheme).from_options(
        bits=bits,
        granularity=granularity,
        block_size=block_size,
        linear_mode=linear_mode,
        stat_range=stat_range,
        topk_fraction=topk_fraction,
        topk_value_bits=topk_value_bits,
        topk_chunk=topk_chunk,
    )


def get_compressor_from_config(cfg) -> Compressor:
    """The compressor of a `CompressionConfig` (muloco.config); skip rules and error feedback are the
    engine's (see ErrorFeedback)."""
    return get_compressor(
        cfg.scheme,
        bits=cfg.bits,
        granularity=cfg.granularity,
        block_size=cfg.block_size,
        linear_mode=cfg.linear_mode,
        stat_range=cfg.stat_range,
        topk_fraction=cfg.topk_fraction,
        topk_value_bits=cfg.topk_value_bits,
        topk_chunk=cfg.topk_chunk,
    )


def decode(payload: bytes) -> torch.Tensor:
    """Decode any muloco payload (validated; raises CompressionError) to an fp32 CPU tensor."""
    h, body = parse(payload)
    return scheme_class(h.scheme).decode_sections(h, split_body(h, body))
