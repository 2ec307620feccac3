"""The linear scheme: uniform levels per group, absmax (symmetric) or minmax (affine); see quantize.py."""

from __future__ import annotations

import torch

from muloco.compress.base import check_choice, register_scheme
from muloco.compress.group import GroupQuantizer
from muloco.compress.quantize import LINEAR_MODES, linear_lut
from muloco.compress.wire import Header


@register_scheme
class LinearQuantizer(GroupQuantizer):
    """Uniform levels over [-absmax, absmax] (mode absmax) or [min, max] (mode minmax), per group.
    Every element: |x - x_hat| <= step / 2 (see quantize.py)."""

    scheme = "linear"

    def __init__(self, bits: int = 8, granularity: str = "row", block_size: int = 256, mode: str = "absmax"):
        super().__init__(bits, granularity, block_size)
        check_choice("linear_mode", mode, LINEAR_MODES)
        self.kind = mode

    @classmethod
    def from_options(cls, *, bits, granularity, block_size, linear_mode, **_) -> LinearQuantizer:
        return cls(bits, granularity, block_size, linear_mode)

    def _mode(self) -> int:
        return LINEAR_MODES.index(self.kind)

    @classmethod
    def _read_lut(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        return linear_lut(h.bits, LINEAR_MODES[h.mode])  # a function of the header: nothing travels

    def _repr_args(self) -> dict:
        return {**super()._repr_args(), "linear_mode": self.kind}
