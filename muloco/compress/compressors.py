"""Compressors: thin classes that hold a configuration and turn a tensor into a validated payload and back.

The maths lives in quantize.py / topk.py / packing.py, the byte layout in wire.py. Every compressor writes
a self-describing payload; `decode(payload)` (module level) reads any of them, `Compressor.decode` also
checks that the payload was made with this compressor's settings (a mismatch means workers disagree on
the compression config).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from muloco.compress.errors import CompressionError
from muloco.compress.packing import pack_codes, uint_width
from muloco.compress.quantize import (
    BF16_MAX,
    DEFAULT_STAT_RANGE,
    GRANULARITIES,
    LINEAR_MODES,
    dequantize,
    linear_lut,
    num_groups,
    quantize,
    raise_non_finite,
)
from muloco.compress.topk import decode_indices, encode_indices, select_topk, topk_count
from muloco.compress.wire import (
    CRC_NBYTES,
    DTYPES,
    MAX_NDIM,
    MAX_NUMEL,
    SCHEMES,
    TOPK_MAX_EXPANSION,
    Header,
    assemble,
    body_layout,
    parse,
)

QUANT_BITS = (1, 2, 4, 8)
MIN_TOPK_FRACTION = 1.0 / TOPK_MAX_EXPANSION
TOPK_VALUE_BITS = (8, 16, 32)


class Compressor(ABC):
    """encode(tensor) -> bytes; decode(bytes) -> fp32 CPU tensor of the original shape."""

    scheme: str

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes) -> torch.Tensor:
        """Validate `payload` (raises CompressionError), check it matches this compressor, decode it."""
        with torch.profiler.record_function("muloco::compress::decode"):
            h, body = parse(payload)
            self._check_header(h)
            return _decode_body(h, body)

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


# ---- encode helpers -------------------------------------------------------------------------------------


def _prepare(tensor) -> tuple[torch.Tensor, torch.dtype]:
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


def _check_finite(x: torch.Tensor) -> None:
    """Raise CompressionError if x holds NaN/Inf. One fast reduction; the exact count only on failure."""
    if not bool(torch.isfinite(x.sum())):
        raise_non_finite(x)  # returns if the sum merely overflowed


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _int16(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> its bit patterns as little-endian int16 (numpy has no bf16)."""
    return _np(t.view(torch.int16))


# ---- the compressors ------------------------------------------------------------------------------------


class NoCompression(Compressor):
    """fp32, bit-exact (for fp32 input)."""

    scheme = "none"

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = _prepare(tensor)
        _check_finite(x)
        return assemble(self._header(x.shape, dtype), [_np(x).reshape(-1)])

    def _header(self, shape, dtype=torch.float32) -> Header:
        n = math.prod(shape)
        return Header("none", 32, "tensor", 0, dtype, tuple(shape), 0, 0, 4 * n)

    _body_header = _header

    def _header_fields(self) -> dict:
        return {"scheme": "none"}


class BF16Compression(Compressor):
    """bfloat16: 16 bits, relative error <= 2**-9 per element (round to nearest)."""

    scheme = "bf16"

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = _prepare(tensor)
        y = x.to(torch.bfloat16)
        if not bool(torch.isfinite(y.sum(dtype=torch.float32))):
            raise_non_finite(x)
            if bool(torch.isinf(y).any()):
                raise CompressionError(
                    f"values beyond the bf16 range (|x| > {BF16_MAX:.3g}); use scheme none"
                )
        return assemble(self._header(x.shape, dtype), [_int16(y).reshape(-1)])

    def _header(self, shape, dtype=torch.float32) -> Header:
        n = math.prod(shape)
        return Header("bf16", 16, "tensor", 0, dtype, tuple(shape), 0, 0, 2 * n)

    _body_header = _header

    def _header_fields(self) -> dict:
        return {"scheme": "bf16"}


class _GroupQuantizer(Compressor):
    """Shared by the linear and statistical quantizers (same wire sections, same decoder)."""

    kind: str  # absmax | minmax | statistical

    def __init__(self, bits: int, granularity: str, block_size: int):
        _check_choice("bits", bits, QUANT_BITS)
        _check_choice("granularity", granularity, GRANULARITIES)
        _check_block_size(block_size)
        self.bits, self.granularity, self.block_size = bits, granularity, block_size

    @property
    def _stored_block_size(self) -> int:
        return self.block_size if self.granularity == "block" else 0

    def _mode(self) -> int:
        return LINEAR_MODES.index(self.kind) if self.scheme == "linear" else 0

    def _body_header(self, shape, dtype=torch.float32) -> Header:
        groups = num_groups(shape, self.granularity, self.block_size)
        h = Header(self.scheme, self.bits, self.granularity, self._mode(), dtype, tuple(shape),
                   self._stored_block_size, groups, 0)  # fmt: skip
        return _with_body_size(h)

    def _header_fields(self) -> dict:
        return {
            "scheme": self.scheme,
            "bits": self.bits,
            "granularity": self.granularity,
            "mode": self._mode(),
            "block_size": self._stored_block_size,
        }

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = _prepare(tensor)
        with torch.profiler.record_function(f"muloco::compress::{self.scheme}{self.bits}"):
            q = quantize(x, self.bits, self.kind, self.granularity, self.block_size, self._stat_range())
            sections = []
            if q.offsets is not None:
                sections.append(_np(q.offsets))
            sections.append(_int16(q.steps))
            if self.scheme == "statistical":
                sections.append(_np(q.lut))
            sections.append(_np(pack_codes(q.codes, self.bits)))
        return assemble(self._body_header(tuple(x.shape), dtype), sections)

    def _stat_range(self) -> float | None:
        return None

    def _repr_args(self) -> dict:
        args = {"bits": self.bits, "granularity": self.granularity}
        if self.granularity == "block":
            args["block_size"] = self.block_size
        return args


class LinearQuantizer(_GroupQuantizer):
    """Uniform levels over [-absmax, absmax] (mode absmax) or [min, max] (mode minmax), per group.
    Every element: |x - x_hat| <= step / 2 (see quantize.py)."""

    scheme = "linear"

    def __init__(self, bits: int = 8, granularity: str = "row", block_size: int = 256, mode: str = "absmax"):
        super().__init__(bits, granularity, block_size)
        _check_choice("linear_mode", mode, LINEAR_MODES)
        self.kind = mode

    def _repr_args(self) -> dict:
        return {**super()._repr_args(), "linear_mode": self.kind}


class StatisticalQuantizer(_GroupQuantizer):
    """Mean-centred bins over +-stat_range standard deviations, decoded to bin centroids (MuLoCo's
    row-wise statistical quantizer; hivemind's Uniform8Bit made group-wise; see quantize.py)."""

    scheme = "statistical"
    kind = "statistical"

    def __init__(self, bits: int = 8, granularity: str = "row", block_size: int = 256, stat_range=None):
        super().__init__(bits, granularity, block_size)
        _check_stat_range(stat_range)
        self.stat_range = DEFAULT_STAT_RANGE[bits] if stat_range is None else float(stat_range)

    def _stat_range(self) -> float:
        return self.stat_range

    def _repr_args(self) -> dict:
        return {**super()._repr_args(), "stat_range": self.stat_range}


class TopK(Compressor):
    """Keep the ceil(fraction * n) largest-magnitude entries; the rest decode to 0.
    Values travel as fp32, bf16, or 8-bit linear absmax with one bf16 step per tensor."""

    scheme = "topk"

    def __init__(self, fraction: float = 0.01, value_bits: int = 32):
        _check_fraction(fraction)
        _check_choice("topk_value_bits", value_bits, TOPK_VALUE_BITS)
        self.fraction, self.value_bits = float(fraction), value_bits

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = _prepare(tensor)
        _check_finite(x)
        flat = x.view(-1)
        k = topk_count(flat.numel(), self.fraction)
        with torch.profiler.record_function("muloco::compress::topk"):
            idx, vals = select_topk(flat, k)
            width, packed_idx = encode_indices(idx)
            sections = [_np(packed_idx)]
            if self.value_bits == 32:
                sections.append(_np(vals))
            elif self.value_bits == 16:
                v16 = vals.to(torch.bfloat16)
                if not bool(torch.isfinite(v16).all()):
                    raise CompressionError(f"values beyond the bf16 range (|x| > {BF16_MAX:.3g})")
                sections.append(_int16(v16))
            else:
                q = quantize(vals.contiguous(), 8, "absmax", "tensor")
                step = q.steps if k else torch.zeros(1, dtype=torch.bfloat16)  # k = 0: no group, a 0 step
                sections += [_int16(step), _np(q.codes)]
        h = Header("topk", self.value_bits, "tensor", width, dtype, tuple(x.shape), 0, k, 0)
        return assemble(_with_body_size(h), sections)

    def _body_header(self, shape) -> Header:
        n = math.prod(shape)
        k = topk_count(n, self.fraction)
        width = uint_width(n - k)  # the largest possible gap: an upper bound
        return _with_body_size(
            Header("topk", self.value_bits, "tensor", width, torch.float32, shape, 0, k, 0)
        )

    def _header_fields(self) -> dict:
        return {"scheme": "topk", "bits": self.value_bits}

    def _check_header(self, h: Header) -> None:
        super()._check_header(h)
        k = topk_count(h.numel, self.fraction)
        if h.count != k:  # also bounds the dense output: numel <~ count / fraction
            raise CompressionError(
                f"payload keeps {h.count} of {h.numel} entries, this compressor keeps {k} "
                f"(topk_fraction {self.fraction}): do all workers use the same compression config?"
            )

    def _repr_args(self) -> dict:
        return {"topk_fraction": self.fraction, "topk_value_bits": self.value_bits}


# ---- decode ---------------------------------------------------------------------------------------------


def _with_body_size(h: Header) -> Header:
    body = sum(n for _, n in body_layout(h))
    return Header(h.scheme, h.bits, h.granularity, h.mode, h.dtype, h.shape, h.block_size, h.count, body)


def _sections(h: Header, body: memoryview) -> dict[str, memoryview]:
    out, pos = {}, 0
    for name, n in body_layout(h):
        out[name] = body[pos : pos + n]
        pos += n
    assert pos == body.nbytes, f"{pos=} {body.nbytes=}"
    return out


def _arr(mv: memoryview, dtype: str) -> np.ndarray:
    return np.frombuffer(mv, dtype=dtype)


def _bf16(mv: memoryview) -> torch.Tensor:
    """bf16 bit patterns (little-endian int16) -> fp32 tensor."""
    return torch.from_numpy(_arr(mv, "<i2").copy()).view(torch.bfloat16).float()


def _malformed(msg: str) -> CompressionError:
    return CompressionError(f"malformed compressed payload: {msg}")


def _check_stats(name: str, t: torch.Tensor, nonneg: bool = False) -> None:
    if not bool(torch.isfinite(t).all()) or (nonneg and bool((t < 0).any())):
        raise _malformed(f"{name} hold non-finite{' or negative' if nonneg else ''} values")


def _decode_body(h: Header, body: memoryview) -> torch.Tensor:
    """fp32 CPU tensor of `h.shape` from a validated body."""
    sec = _sections(h, body)
    shape = h.shape
    if h.scheme == "none":
        return torch.from_numpy(_arr(sec["values"], "<f4").copy()).view(shape)
    if h.scheme == "bf16":
        return _bf16(sec["values"]).view(shape)
    if h.scheme in ("linear", "statistical"):
        steps = _bf16(sec["steps"])
        _check_stats("steps", steps, nonneg=True)
        offsets = None
        if "offsets" in sec:
            offsets = torch.from_numpy(_arr(sec["offsets"], "<f4").copy())
            _check_stats("offsets", offsets)
        if h.scheme == "statistical":
            lut = torch.from_numpy(_arr(sec["lut"], "<f4").copy())
            _check_stats("the lookup table", lut)
        else:
            lut = linear_lut(h.bits, LINEAR_MODES[h.mode])
        codes = _arr(sec["codes"], np.uint8)
        return dequantize(codes, steps, offsets, lut, h.bits, shape, h.granularity, h.block_size or 1)
    # topk
    n, k = h.numel, h.count
    packed_idx = torch.from_numpy(_arr(sec["indices"], np.uint8).copy())
    idx = decode_indices(packed_idx, h.mode, k, n)
    if h.bits == 32:
        vals = torch.from_numpy(_arr(sec["values"], "<f4").copy())
    elif h.bits == 16:
        vals = _bf16(sec["values"])
    else:
        step = _bf16(sec["steps"])
        _check_stats("the top-k step", step, nonneg=True)
        codes = _arr(sec["values"], np.uint8)
        vals = dequantize(codes, step, None, linear_lut(8, "absmax"), 8, (k,), "tensor", 1)
    _check_stats("top-k values", vals)
    out = torch.zeros(n, dtype=torch.float32)
    out[idx] = vals
    return out.view(shape)


def decode(payload: bytes) -> torch.Tensor:
    """Decode any muloco payload (validated; raises CompressionError) to an fp32 CPU tensor."""
    h, body = parse(payload)
    return _decode_body(h, body)


# ---- factories ------------------------------------------------------------------------------------------


def _check_choice(name: str, value, choices: tuple) -> None:
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_block_size(block_size) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 < block_size < 2**31:
        raise ValueError(f"block_size must be an integer in [1, 2**31), got {block_size!r}")


def _check_stat_range(stat_range) -> None:
    if stat_range is not None and not (_is_number(stat_range) and 0 < stat_range <= 1e4):
        raise ValueError(
            f"stat_range must be a number in (0, 1e4] or None (the per-bits default), got {stat_range!r}"
        )


def _check_fraction(fraction) -> None:
    # >= 2**-20: a legitimate payload then always passes the wire's top-k expansion bound (k + 1) * 2**20.
    if not (_is_number(fraction) and MIN_TOPK_FRACTION <= fraction <= 1):
        raise ValueError(f"topk_fraction must be in [{MIN_TOPK_FRACTION:.3g}, 1], got {fraction!r}")


def get_compressor(
    scheme: str,
    bits: int = 8,
    granularity: str = "row",
    block_size: int = 256,
    linear_mode: str = "absmax",
    stat_range: float | None = None,
    topk_fraction: float = 0.01,
    topk_value_bits: int = 32,
) -> Compressor:
    """The compressor for `scheme` (none | bf16 | linear | statistical | topk). Arguments a scheme does not
    use are still validated (a typo should not pass silently). Bad arguments raise ValueError naming them."""
    _check_choice("scheme", scheme, SCHEMES)
    _check_choice("bits", bits, QUANT_BITS)
    _check_choice("granularity", granularity, GRANULARITIES)
    _check_choice("linear_mode", linear_mode, LINEAR_MODES)
    _check_choice("topk_value_bits", topk_value_bits, TOPK_VALUE_BITS)
    _check_block_size(block_size)
    _check_stat_range(stat_range)
    _check_fraction(topk_fraction)
    if scheme == "none":
        return NoCompression()
    if scheme == "bf16":
        return BF16Compression()
    if scheme == "linear":
        return LinearQuantizer(bits, granularity, block_size, linear_mode)
    if scheme == "statistical":
        return StatisticalQuantizer(bits, granularity, block_size, stat_range)
    return TopK(topk_fraction, topk_value_bits)


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
    )
