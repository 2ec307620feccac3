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
    split_body,
    to_numpy,
    with_body_size,
)
from muloco.compress.many import BATCH_MAX, dequantize_many, quantize_many
from muloco.compress.packing import pack_codes
from muloco.compress.quantize import GRANULARITIES, Quantized, dequantize, num_groups
from muloco.compress.wire import Header, assemble, parse
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
        return self.encode_many([tensor])[0]

    def encode_many(self, tensors: list[torch.Tensor]) -> list[bytes]:
        return self._encode(tensors, with_values=False)[0]

    def encode_with_decoded(self, tensors: list[torch.Tensor]) -> tuple[list[bytes], list[torch.Tensor]]:
        payloads, values = self._encode(tensors, with_values=True)
        # a large tensor's x_hat is its payload decoded (many.py computes only the batched ones')
        return payloads, [self.decode(p) if v is None else v for p, v in zip(payloads, values, strict=True)]

    def _encode(self, tensors: list[torch.Tensor], with_values: bool) -> tuple[list[bytes], list | None]:
        prepared = [prepare(t) for t in tensors]
        with torch.profiler.record_function(f"muloco::compress::{self.scheme}{self.bits}"):
            qs, values = quantize_many(
                [x for x, _ in prepared], self.bits, self.kind, self.granularity, self.block_size,
                self._stat_range(), with_values,
            )  # fmt: skip
            payloads = []
            for (x, dtype), q in zip(prepared, qs, strict=True):
                sections = []
                if q.offsets is not None:
                    sections.append(to_numpy(q.offsets))
                sections.append(bf16_bits(q.steps))
                sections += self._lut_sections(q)
                sections.append(to_numpy(pack_codes(q.codes, self.bits)))
                payloads.append(assemble(self._body_header(tuple(x.shape), dtype), sections))
        return payloads, values

    @classmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        return dequantize(*cls._read_sections(h, sections), h.bits, h.shape, h.granularity, h.block_size or 1)

    @classmethod
    def _read_sections(cls, h: Header, sections: dict[str, memoryview], check: bool = True) -> tuple:
        """(packed codes, steps fp32, offsets fp32 or None, lut fp32); the statistics checked unless the
        caller checks many payloads' at once (`_check_read`)."""
        steps = read_bf16(sections["steps"])
        offsets = read_f32(sections["offsets"]) if "offsets" in sections else None
        read = (read_array(sections["codes"], np.uint8), steps, offsets, cls._read_lut(h, sections))
        if check:
            cls._check_read([read])
        return read

    @staticmethod
    def _check_read(reads: list[tuple]) -> None:
        """Decoded statistics must be finite (steps also >= 0), else a payload is malformed."""
        check_stats("steps", torch.cat([r[1] for r in reads]), nonneg=True)
        if reads[0][2] is not None:
            check_stats("offsets", torch.cat([r[2] for r in reads]))
        check_stats("the lookup table", torch.cat([r[3] for r in reads]))

    def decode_many(self, payloads: list[bytes]) -> list[torch.Tensor]:
        """Every payload validated as `decode` does; the small ones dequantized together (many.py)."""
        out: list[torch.Tensor | None] = [None] * len(payloads)
        small, items = [], []
        with torch.profiler.record_function("muloco::compress::decode"):
            for position, payload in enumerate(payloads):
                h, body = parse(payload)
                self._check_header(h)
                sections = split_body(h, body)
                if 0 < h.numel <= BATCH_MAX:
                    small.append(position)
                    items.append((*self._read_sections(h, sections, check=False), h.shape))
                else:
                    out[position] = self.decode_sections(h, sections)
            if items:
                self._check_read(items)
                decoded = dequantize_many(items, self.bits, self.granularity, self.block_size)
                for position, tensor in zip(small, decoded, strict=True):
                    out[position] = tensor
        return out

    def _repr_args(self) -> dict:
        args = {"bits": self.bits, "granularity": self.granularity}
        if self.granularity == "block":
            args["block_size"] = self.block_size
        return args
