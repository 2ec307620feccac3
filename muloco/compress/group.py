"""GroupQuantizer: what the linear and statistical schemes share (quantize.py's group-wise quantizer, the
same wire sections, the same decoder). A subclass names its `kind` and supplies its lookup table."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from muloco.compress.base import (
    Compressor,
    bf16_bits,
    check_block_size,
    check_choice,
    check_stats,
    prepare,
    read_array,
    read_bf16,
    read_f32,
    to_numpy,
    with_body_size,
)
from muloco.compress.packing import pack_codes
from muloco.compress.quantize import GRANULARITIES, Quantized, dequantize, num_groups, quantize
from muloco.compress.wire import Header, assemble
from muloco.config.bits import QUANT_BITS


class GroupQuantizer(Compressor):
    """Codes of `bits` bits plus per-group statistics (groups: the tensor, each row, or blocks).

    Body sections: [offsets fp32 (G,)], steps bf16 (G,), [lut fp32 (2**bits,)], codes packed.
    """

    kind: str  # absmax | minmax | statistical

    def __init__(self, bits: int, granularity: str, block_size: int):
        check_choice("bits", bits, QUANT_BITS)
        check_choice("granularity", granularity, GRANULARITIES)
        check_block_size(block_size)
        self.bits, self.granularity, self.block_size = bits, granularity, block_size

    @property
    def _stored_block_size(self) -> int:
        return self.block_size if self.granularity == "block" else 0

    def _mode(self) -> int:
        """The header's mode field (linear: which of LINEAR_MODES)."""
        return 0

    def _stat_range(self) -> float | None:
        return None

    def _lut_sections(self, q: Quantized) -> list[np.ndarray]:
        """The lookup table, if this scheme sends one (statistical)."""
        return []

    @classmethod
    @abstractmethod
    def _read_lut(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        """The decoder's lookup table: (2**bits,) fp32, in units of step."""

    def _body_header(self, shape, dtype=torch.float32) -> Header:
        groups = num_groups(shape, self.granularity, self.block_size)
        h = Header(self.scheme, self.bits, self.granularity, self._mode(), dtype, tuple(shape),
                   self._stored_block_size, groups, 0)  # fmt: skip
        return with_body_size(h)

    def _header_fields(self) -> dict:
        return {
            "scheme": self.scheme,
            "bits": self.bits,
            "granularity": self.granularity,
            "mode": self._mode(),
            "block_size": self._stored_block_size,
        }

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = prepare(tensor)
        with torch.profiler.record_function(f"muloco::compress::{self.scheme}{self.bits}"):
            q = quantize(x, self.bits, self.kind, self.granularity, self.block_size, self._stat_range())
            sections = []
            if q.offsets is not None:
                sections.append(to_numpy(q.offsets))
            sections.append(bf16_bits(q.steps))
            sections += self._lut_sections(q)
            sections.append(to_numpy(pack_codes(q.codes, self.bits)))
        return assemble(self._body_header(tuple(x.shape), dtype), sections)

    @classmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        steps = read_bf16(sections["steps"])
        check_stats("steps", steps, nonneg=True)
        offsets = None
        if "offsets" in sections:
            offsets = read_f32(sections["offsets"])
            check_stats("offsets", offsets)
        lut = cls._read_lut(h, sections)
        codes = read_array(sections["codes"], np.uint8)
        return dequantize(codes, steps, offsets, lut, h.bits, h.shape, h.granularity, h.block_size or 1)

    def _repr_args(self) -> dict:
        args = {"bits": self.bits, "granularity": self.granularity}
        if self.granularity == "block":
            args["block_size"] = self.block_size
        return args
