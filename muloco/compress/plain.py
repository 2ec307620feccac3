"""The unquantized schemes: none (fp32, bit-exact) and bf16 (round to nearest)."""

from __future__ import annotations

import math

import torch

from muloco.compress.base import (
    Compressor,
    bf16_bits,
    check_finite,
    prepare,
    read_bf16,
    read_f32,
    register_scheme,
    to_numpy,
)
from muloco.compress.errors import CompressionError
from muloco.compress.quantize import BF16_MAX, raise_non_finite
from muloco.compress.wire import Header, assemble


class _Unquantized(Compressor):
    """Values stored whole, `bits` per element, one section: what none and bf16 share."""

    bits = 32

    def _body_header(self, shape, dtype=torch.float32) -> Header:
        n = math.prod(shape)
        return Header(self.scheme, self.bits, "tensor", 0, dtype, tuple(shape), 0, 0, self.bits // 8 * n)

    def _header_fields(self) -> dict:
        return {"scheme": self.scheme}


@register_scheme
class NoCompression(_Unquantized):
    """fp32, bit-exact (for fp32 input)."""

    scheme = "none"

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = prepare(tensor)
        check_finite(x)
        return assemble(self._body_header(x.shape, dtype), [to_numpy(x).reshape(-1)])

    @classmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        return read_f32(sections["values"]).view(h.shape)


@register_scheme
class BF16Compression(_Unquantized):
    """bfloat16: 16 bits, relative error <= 2**-9 per element (round to nearest)."""

    scheme = "bf16"
    bits = 16

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = prepare(tensor)
        y = x.to(torch.bfloat16)
        if not bool(torch.isfinite(y.sum(dtype=torch.float32))):
            raise_non_finite(x)
            if bool(torch.isinf(y).any()):
                raise CompressionError(
                    f"values beyond the bf16 range (|x| > {BF16_MAX:.3g}); use scheme none"
                )
        return assemble(self._body_header(x.shape, dtype), [bf16_bits(y).reshape(-1)])

    @classmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        return read_bf16(sections["values"]).view(h.shape)
