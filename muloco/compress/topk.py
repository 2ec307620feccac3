"""Top-k sparsification as pure functions: which entries to keep and how their indices travel.

Per tensor (`chunk` unset): the k largest of the whole tensor; indices are sorted and delta-coded (gap_0 =
i_0, gap_j = i_j - i_(j-1) - 1 >= 0), then packed at the minimal width that holds the largest gap. With k =
fraction * n entries spread over n, the gaps are about 1 / fraction, so indices cost ~log2(1 / fraction) + a
few bits each instead of log2(n) (e.g. ~12 instead of 24 bits at 1% of 16M).

Chunked (`chunk` = entries per chunk, a square: SparseLoCo's tiles, chunks.py): the k largest of every chunk,
each index its position in the chunk at log2(chunk) bits (12 at 4,096), vectorised over the chunks.

The kept values travel as fp32, bf16, 8-bit linear absmax, or 4 / 2-bit statistical over all the tensor's kept
values (mean-centred bins decoded to their centroids, quantize.py; SparseLoCo sends its values at 2 bits the
same way, with its own bin edges).

The pure functions come first; `TopK`, the scheme's compressor, holds the fraction, chunk and value bits and
calls them. Body sections: indices (packed gaps, or in-chunk positions), [offset fp32 (1,)], [step bf16 (1,)
for 8/4/2-bit values], [lut fp32 (2**bits,) for 4/2-bit values], values.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from muloco.compress.base import (
    Compressor,
    bf16_bits,
    check_choice,
    check_finite,
    check_stats,
    is_number,
    prepare,
    read_array,
    read_bf16,
    read_f32,
    register_scheme,
    to_numpy,
    with_body_size,
)
from muloco.compress.chunks import Tiling, from_chunks, kept_per_chunk, tiling, to_chunks
from muloco.compress.errors import CompressionError
from muloco.compress.packing import pack_codes, pack_uint, uint_width, unpack_uint
from muloco.compress.quantize import BF16_MAX, dequantize, linear_lut, quantize
from muloco.compress.wire import TOPK_MAX_EXPANSION, Header, assemble
from muloco.config.bits import TOPK_VALUE_BITS, check_chunk

MIN_TOPK_FRACTION = 1.0 / TOPK_MAX_EXPANSION


def topk_count(n: int, fraction: float) -> int:
    """Entries kept out of `n`: ceil(fraction * n), at least 1 (for n > 0), at most n."""
    if n == 0:
        return 0
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def select_topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest-magnitude entries of a flat tensor: (indices ascending int64, their values).

    Large tensors: a threshold from a strided sample keeps ~1.5 k candidates, and an exact top-k runs on
    those (10x faster than torch.topk over 16M entries on a CPU). Exact: if at least k entries reach the
    threshold, the k largest are among them; otherwise we fall back to the full top-k. Ties are broken
    arbitrarily, as by torch.topk.
    """
    n = flat.numel()
    if k == n:
        idx = torch.arange(k, device=flat.device)
        return idx, flat[idx]
    mag = flat.abs()
    cand = None
    if n >= 1 << 18 and 4 * k < n:
        stride = max(1, n // (1 << 16))
        sample = mag[::stride]
        rank = min(sample.numel(), math.ceil(1.5 * k * sample.numel() / n) + 16)
        threshold = torch.topk(sample, rank, sorted=False).values.min()
        above = torch.nonzero(mag >= threshold).squeeze(1)  # (m,) ascending
        if above.numel() >= k:
            cand = above
    if cand is None:
        idx = torch.topk(mag, k, sorted=False).indices
    else:
        idx = cand[torch.topk(mag[cand], k, sorted=False).indices]
    idx = idx.sort().values
    return idx, flat[idx]


def encode_indices(idx: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(width, packed bytes) of ascending unique indices, delta-coded."""
    if idx.numel() == 0:
        return 1, torch.empty(0, dtype=torch.uint8)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1  # (k,) >= 0
    width = uint_width(int(gaps.max()))
    return width, pack_uint(gaps, width)


def decode_indices(packed: torch.Tensor, width: int, k: int, n: int) -> torch.Tensor:
    """Inverse of `encode_indices`; checks that every index is < n (gaps >= 0 make them unique)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    gaps = unpack_uint(packed, width, k)
    # The last index is sum(gaps) + k - 1; summed in fp64 first so that absurd gaps cannot wrap int64.
    last = float(gaps.double().sum()) + k - 1
    if last >= n:
        raise CompressionError(f"malformed compressed payload: top-k index {last:.0f} >= numel {n}")
    return torch.cumsum(gaps + 1, dim=0) - 1  # (k,) strictly increasing


def check_fraction(fraction) -> None:
    # >= 2**-20: a legitimate payload then always passes the wire's top-k expansion bound (k + 1) * 2**20.
    if not (is_number(fraction) and MIN_TOPK_FRACTION <= fraction <= 1):
        raise ValueError(f"topk_fraction must be in [{MIN_TOPK_FRACTION:.3g}, 1], got {fraction!r}")


def select_chunked(x: torch.Tensor, t: Tiling, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest-magnitude entries of every chunk: (positions in the chunk ascending, (chunks, k)
    int64; their values (chunks, k)). One batched top-k over all chunks; ties as torch.topk breaks them."""
    chunks = to_chunks(x, t)
    if k == t.chunk_len:
        idx = torch.arange(k, device=x.device).expand(t.chunks, k)
    else:
        idx = torch.topk(chunks.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, chunks.gather(1, idx)


def decode_chunk_positions(packed: torch.Tensor, width: int, t: Tiling, k: int) -> torch.Tensor:
    """Inverse of packing `select_chunked`'s positions: (chunks, k), each row strictly increasing and below
    the chunk's length (checked: a malformed payload must not write one entry twice or out of its chunk)."""
    idx = unpack_uint(packed, width, t.chunks * k).view(t.chunks, k)
    if idx.numel() and (int(idx[:, -1].max()) >= t.chunk_len or bool((idx.diff(dim=1) <= 0).any())):
        raise CompressionError(
            "malformed compressed payload: chunked top-k positions not increasing "
            f"within 0..{t.chunk_len - 1}"
        )
    return idx


def encode_values(vals: torch.Tensor, bits: int) -> list[np.ndarray]:
    """The body sections of the kept values (flat fp32) at `bits`."""
    if bits == 32:
        return [to_numpy(vals)]
    if bits == 16:
        v16 = vals.to(torch.bfloat16)
        if not bool(torch.isfinite(v16).all()):
            raise CompressionError(f"values beyond the bf16 range (|x| > {BF16_MAX:.3g})")
        return [bf16_bits(v16)]
    if vals.numel() == 0:  # no group: a zero step (and offset, table) keeps the layout fixed
        zero = torch.zeros(1)
        lut = [] if bits == 8 else [to_numpy(torch.zeros(2**bits))]
        return [
            *([] if bits == 8 else [to_numpy(zero)]),
            bf16_bits(zero.bfloat16()),
            *lut,
            np.zeros(0, np.uint8),
        ]
    if bits == 8:
        q = quantize(vals.contiguous(), 8, "absmax", "tensor")
        return [bf16_bits(q.steps), to_numpy(q.codes)]
    q = quantize(vals.contiguous(), bits, "statistical", "tensor")
    return [to_numpy(q.offsets), bf16_bits(q.steps), to_numpy(q.lut), to_numpy(pack_codes(q.codes, bits))]


def decode_values(sections: dict[str, memoryview], bits: int, k: int) -> torch.Tensor:
    """Inverse of `encode_values`: (k,) fp32, statistics checked."""
    if bits == 32:
        vals = read_f32(sections["values"])
    elif bits == 16:
        vals = read_bf16(sections["values"])
    else:
        step = read_bf16(sections["steps"])
        check_stats("the top-k step", step, nonneg=True)
        codes = read_array(sections["values"], np.uint8)
        if bits == 8:
            vals = dequantize(codes, step, None, linear_lut(8, "absmax"), 8, (k,), "tensor", 1)
        else:
            offset, lut = read_f32(sections["offsets"]), read_f32(sections["lut"])
            check_stats("the top-k offset and lookup table", torch.cat([offset, lut]))
            vals = dequantize(codes, step, offset, lut, bits, (k,), "tensor", 1)
    check_stats("top-k values", vals)
    return vals


@register_scheme
class TopK(Compressor):
    """Keep the largest-magnitude entries, of the whole tensor (ceil(fraction * n)) or of every chunk
    (`chunk` entries, a square; chunks.py); the rest decode to 0. Values travel at `value_bits`."""

    scheme = "topk"

    def __init__(self, fraction: float = 0.01, value_bits: int = 32, chunk: int | None = None):
        check_fraction(fraction)
        check_choice("topk_value_bits", value_bits, TOPK_VALUE_BITS)
        self.side = check_chunk(chunk)
        self.fraction, self.value_bits, self.chunk = float(fraction), value_bits, chunk

    @classmethod
    def from_options(cls, *, topk_fraction, topk_value_bits, topk_chunk=None, **_) -> TopK:
        return cls(topk_fraction, topk_value_bits, topk_chunk)

    def kept(self, shape: tuple[int, ...]) -> int:
        """Entries a payload of `shape` keeps."""
        if self.side is None:
            return topk_count(math.prod(shape), self.fraction)
        t = tiling(shape, self.side)
        return t.chunks * kept_per_chunk(t.chunk_len, self.fraction) if t.chunks else 0

    def encode(self, tensor: torch.Tensor) -> bytes:
        x, dtype = prepare(tensor)
        check_finite(x)
        with torch.profiler.record_function("muloco::compress::topk"):
            if self.side is None:
                k = topk_count(x.numel(), self.fraction)
                idx, vals = select_topk(x.view(-1), k)
                width, packed_idx = encode_indices(idx)
            else:
                t = tiling(tuple(x.shape), self.side)
                k = self.kept(tuple(x.shape))
                width = uint_width(t.chunk_len - 1)
                if k:
                    idx, vals = select_chunked(x, t, k // t.chunks)
                    packed_idx, vals = pack_uint(idx.reshape(-1), width), vals.reshape(-1)
                else:
                    packed_idx, vals = torch.empty(0, dtype=torch.uint8), x.view(-1)
            sections = [to_numpy(packed_idx), *encode_values(vals, self.value_bits)]
        h = Header("topk", self.value_bits, self._granularity, width, dtype, tuple(x.shape), self._side, k, 0)
        return assemble(with_body_size(h), sections)

    @classmethod
    def decode_sections(cls, h: Header, sections: dict[str, memoryview]) -> torch.Tensor:
        n, k = h.numel, h.count
        packed_idx = torch.from_numpy(read_array(sections["indices"], np.uint8).copy())
        vals = decode_values(sections, h.bits, k)
        if h.granularity == "tensor":
            idx = decode_indices(packed_idx, h.mode, k, n)
            out = torch.zeros(n, dtype=torch.float32)
            out[idx] = vals
            return out.view(h.shape)
        t = tiling(h.shape, h.block_size)
        if not k:
            return torch.zeros(h.shape, dtype=torch.float32)
        idx = decode_chunk_positions(packed_idx, h.mode, t, k // t.chunks)
        chunks = torch.zeros(t.chunks, t.chunk_len, dtype=torch.float32)
        chunks.scatter_(1, idx, vals.view(t.chunks, -1))
        return from_chunks(chunks, t, h.shape)

    @property
    def _granularity(self) -> str:
        return "tensor" if self.side is None else "block"

    @property
    def _side(self) -> int:
        return 0 if self.side is None else self.side

    def _body_header(self, shape) -> Header:
        k = self.kept(shape)
        if self.side is None:
            width = uint_width(math.prod(shape) - k)  # the largest possible gap: an upper bound
        else:
            width = uint_width(tiling(shape, self.side).chunk_len - 1)  # exact
        h = Header("topk", self.value_bits, self._granularity, width, torch.float32, shape, self._side, k, 0)
        return with_body_size(h)

    def _header_fields(self) -> dict:
        return {
            "scheme": "topk",
            "bits": self.value_bits,
            "granularity": self._granularity,
            "block_size": self._side,
        }

    def _check_header(self, h: Header) -> None:
        super()._check_header(h)
        k = self.kept(h.shape)
        if h.count != k:  # also bounds the dense output: numel <~ count / fraction
            raise CompressionError(
                f"payload keeps {h.count} of {h.numel} entries, this compressor keeps {k} "
                f"(topk_fraction {self.fraction}): do all workers use the same compression config?"
            )

    def _repr_args(self) -> dict:
        args = {"topk_fraction": self.fraction, "topk_value_bits": self.value_bits}
        return {**args, "topk_chunk": self.chunk} if self.chunk is not None else args
