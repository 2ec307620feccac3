"""The statistical scheme: MuLoCo's row-wise statistical quantizer, group-wise and any-bits (quantize.py)."""

from __future__ import annotations

import numpy as np
import torch

from muloco.compress.base import is_number, read_f32, register_scheme, to_numpy
from muloco.compress.group import GroupQuantizer
from muloco.compress.quantize import DEFAULT_STAT_RANGE, Quantized
from muloco.compress.wire import Header


def check_stat_range(stat_range) -> None:
    if stat_range is not None and not (is_number(stat_range) and 0 < stat_range <= 1e4):
        raise ValueError(
            f"stat_range must be a number in (0, 1e4] or None (the per-bits default), got {stat_range!r}"
        )


@register_scheme
class StatisticalQuantizer(GroupQuantizer):
    """Mean-centred bins over +-stat_range standard deviations, decoded to bin centroids (MuLoCo's
    row-wise statistical quantizer; hivemind's Uniform8Bit made group-wise; see quantize.py)."""

    scheme = "statistical"
    kind = "statistical"

    def __init__(self, bits: int = 8, granularity: str = "row", block_size: int = 256, stat_range=None):
        super().__init__(bits, granularity, block_size)
        check_stat_range(stat_range)
        self.stat_range = DEFAULT_STAT_RANGE[bits] if stat_range is None else float(stat_range)

    @classmethod
    def from_options(cls, *, bits, granularity, block_size, stat_range, **_) -> StatisticalQuantizer:
        return cls(bits, granularity, block_size, stat_range)

    def _stat_range(self) -> float:
        return self.stat_range

    def _lut_sections(self, q: Quantized) -> list[np.ndarray]:
        return [to_numpy(q.lut)]  # the bin centroids, pooled over the tensor: 2**bits fp32

    @classmethod
    def _read_lut(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        return read_f32(sections["lut"])  # checked with the statistics (GroupQuantizer._check_read)

    def _repr_args(self) -> dict:
        return {**super()._repr_args(), "stat_range": self.stat_range}
