"""The Compressor contract, the scheme registry, and the helpers every scheme's encode / decode shares.

A scheme is a Compressor subclass registered under its wire name (`@register_scheme`); it owns both halves:
`encode(tensor)` writes a self-describing payload (wire.py), `decode_sections(h, sections)` reads one back.
`Compressor.decode` also checks that the payload was made with this compressor's settings (a mismatch
means workers disagree on the compression config); factory.decode reads any payload.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from muloco.compress.errors import CompressionError
from muloco.compress.quantize import raise_non_finite
from muloco.compress.wire import CRC_NBYTES, DTYPES, MAX_NDIM, MAX_NUMEL, SCHEMES, Header, body_layout, parse


class Compressor(ABC):
    """encode(tensor) -> bytes; decode(bytes) -> fp32 CPU tensor of the original shape."""

    scheme: str

    @classmethod
    def from_options(cls, **options) -> Compressor:
        """This scheme's compressor from get_compressor's (already validated) keyword arguments; a scheme
        picks the ones it uses."""
        return cls()

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytes: ...

    @classmethod
    @abstractmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        """fp32 CPU tensor of `h.shape` from the body sections of a validated payload of this scheme."""

    def decode(self, payload: bytes) -> torch.Tensor:
        """Validate `payload` (raises CompressionError), check it matches this compressor, decode it."""
        with torch.profiler.record_function("muloco::compress::decode"):
            h, body = parse(payload)
            self._check_header(h)
            return self.decode_sections(h, split_body(h, body))

    def encode_many(self, tensors: list[torch.Tensor]) -> list[bytes]:
        """`encode` of each tensor (a scheme may batch them; the bytes are the same)."""
        return [self.encode(t) for t in tensors]

    def encode_with_decoded(self, tensors: list[torch.Tensor]) -> tuple[list[bytes], list[torch.Tensor]]:
        """Each tensor's payload and what `decode` makes of it (error feedback keeps the difference)."""
        payloads = self.encode_many(tensors)
        return payloads, [self.decode(p) for p in payloads]

    def decode_many(self, payloads: list[bytes]) -> list[torch.Tensor]:
        """`decode` of each payload (a scheme may batch them; the tensors are the same)."""
        return [self.decode(p) for p in payloads]

    def _check_header(self, h: Header) -> None:
        mine = self._header_fields()
        theirs = {k: getattr(h, k) for k in mine}
        if theirs != mine:
            raise CompressionError(
                f"payload was encoded with {theirs}, this compressor is {mine}: "
                "do all workers use the same compression config?"
            )

    @abstractmethod
    def _header_fields(self) -> dict:
        """The header fields a payload of this compressor must carry (checked by `decode`)."""

    @abstractmethod
    def _body_header(self, shape: tuple[int, ...]) -> Header:
        """The header of a payload for `shape` (for topk: an upper bound on the index width)."""

    def payload_nbytes(self, shape) -> int:
        """Bytes of the payload for a tensor of `shape`, header and CRC included (topk: an upper bound)."""
        h = self._body_header(tuple(int(d) for d in shape))
        return h.nbytes + sum(n for _, n in body_layout(h)) + CRC_NBYTES

    def estimate_bits_per_param(self, shape) -> float:
        """Effective bits per element on the wire, all overhead included (header, scales, tables, CRC)."""
        n = math.prod(int(d) for d in shape)
        return 8 * self.payload_nbytes(shape) / max(n, 1)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._repr_args().items())
        return f"{type(self).__name__}({args})"

    def _repr_args(self) -> dict:
        return {}


# ---- the registry ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Compressor]] = {}


def register_scheme(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make `cls` the compressor of scheme `cls.scheme` (a name the wire format knows)."""
    assert cls.scheme in SCHEMES, f"{cls.scheme=} has no wire code in {SCHEMES=}"
    assert _REGISTRY.get(cls.scheme, cls) is cls, f"scheme {cls.scheme!r} registered twice"
    _REGISTRY[cls.scheme] = cls
    return cls


def registered_schemes() -> tuple[str, ...]:
    """The registered scheme names, in wire-code order."""
    return tuple(s for s in SCHEMES if s in _REGISTRY)


def scheme_class(scheme: str) -> type[Compressor]:
    """The compressor class of `scheme`; ValueError naming the registered schemes if there is none."""
    check_choice("scheme", scheme, registered_schemes())
    return _REGISTRY[scheme]


# ---- encode helpers -------------------------------------------------------------------------------------


def prepare(tensor) -> tuple[torch.Tensor, torch.dtype]:
    """fp32 contiguous view/copy of `tensor`, and its original dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise CompressionError(f"encode expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise CompressionError(
            f"encode expects a floating-point tensor (float32, bfloat16, float16, float64), "
            f"got {tensor.dtype}"
        )
    if tensor.dim() > MAX_NDIM:
        raise CompressionError(f"encode supports tensors of at most {MAX_NDIM} dims, got {tensor.dim()}")
    if tensor.numel() > MAX_NUMEL:
        raise CompressionError(f"tensor of {tensor.numel()} elements exceeds the wire limit {MAX_NUMEL}")
    x = tensor.detach()
    if x.dtype != torch.float32:
        x = x.float()
    return x.contiguous(), tensor.dtype


def check_finite(x: torch.Tensor) -> None:
    """Raise CompressionError if x holds NaN/Inf. One fast reduction; the exact count only on failure."""
    if not bool(torch.isfinite(x.sum())):
        raise_non_finite(x)  # returns if the sum merely overflowed


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its bit patterns as little-endian int16 (numpy has no bf16)."""
    return to_numpy(t.view(torch.int16))


def with_body_size(h: Header) -> Header:
    """`h` with body_nbytes set from its other fields."""
    body = sum(n for _, n in body_layout(h))
    return Header(h.scheme, h.bits, h.granularity, h.mode, h.dtype, h.shape, h.block_size, h.count, body)


# ---- decode helpers -------------------------------------------------------------------------------------


def split_body(h: Header, body: memoryview) -> dict[str, memoryview]:
    """The body's sections by name (zero-copy views), as `body_layout(h)` lays them out."""
    out, pos = {}, 0
    for name, n in body_layout(h):
        out[name] = body[pos : pos + n]
        pos += n
    assert pos == body.nbytes, f"{pos=} {body.nbytes=}"
    return out


def read_array(mv: memoryview, dtype) -> np.ndarray:
    """A read-only numpy view of a section."""
    return np.frombuffer(mv, dtype=dtype)


def read_f32(mv: memoryview) -> torch.Tensor:
    """little-endian fp32 section -> fp32 tensor (a copy)."""
    return torch.from_numpy(read_array(mv, "<f4").copy())


def read_bf16(mv: memoryview) -> torch.Tensor:
    """bf16 bit patterns (little-endian int16) -> fp32 tensor."""
    return torch.from_numpy(read_array(mv, "<i2").copy()).view(torch.bfloat16).float()


def check_stats(name: str, t: torch.Tensor, nonneg: bool = False) -> None:
    """Decoded statistics must be finite (and >= 0 where `nonneg`), else the payload is malformed."""
    if not bool(torch.isfinite(t).all()) or (nonneg and bool((t < 0).any())):
        raise CompressionError(
            f"malformed compressed payload: {name} hold non-finite{' or negative' if nonneg else ''} values"
        )


# ---- argument checks (ValueError naming the argument) ----------------------------------------------------


def check_choice(name: str, value, choices: tuple) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_block_size(block_size) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 < block_size < 2**31:
        raise ValueError(f"block_size must be an integer in [1, 2**31), got {block_size!r}")
