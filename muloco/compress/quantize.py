"""Group-wise quantizers as pure functions: statistics, codes, lookup tables, dequantization.

A tensor is cut into *groups* that share quantization statistics: the whole tensor (`tensor`), each row
(`row`: the tensor reshaped to (shape[0], -1); 0-D and 1-D tensors are one row) or flat blocks of
`block_size` elements (`block`; the last block may be partial). Every quantizer here has the same form:

    code = clamp(floor(x * inv + shift), 0, 2**bits - 1)          # per group: inv = 1 / step, shift
    x_hat = offset + step * lut[code]                            # per group: offset (fp32), step (bf16)

so one decoder serves all of them; only the statistics and the lookup table `lut` (in units of `step`) differ:

- linear absmax: symmetric around 0, step = absmax / qmax with qmax = 2**(bits-1) - 1 (mid-tread: 0 is
  exact; 2 bits is ternary {-absmax, 0, absmax}); 1 bit is mid-rise: {-absmax/2, +absmax/2}. No offset.
  |x - x_hat| <= step / 2.
- linear minmax: step = (max - min) / (2**bits - 1), offset = min, lut[j] = j. |x - x_hat| <= step / 2.
- statistical: mean-centred, 2**bits equal bins over [mean - r * std, mean + r * std] (values outside fall
  in the two outer bins); each code decodes to the *centroid* of its bin: the mean of the values that fell
  in it (so outliers pull the outer bins' centroids out). This is hivemind's `Uniform8BitQuantization`
  (hivemind/compression/quantization.py: mean shift, range in std units, `average_buckets` lookup table) made
  group-wise and any-bits, the "row-wise statistical" quantizer of MuLoCo (Therien et al. 2025,
  arXiv 2505.23725). Our difference: the centroids are measured in units of each group's step and pooled over
  the whole tensor, so one table of 2**bits fp32 travels per tensor instead of one per row (a per-row table of
  16 fp16 entries would add 1 bit per parameter to a 4-bit row of 256). In-range values:
  |x - x_hat| <= step = 2 * r * std / 2**bits.

Steps travel as bf16, rounded up (so absmax / minmax never clip); offsets as fp32. The encoder quantizes
against the rounded values, so decoding reproduces exactly what the encoder measured.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from muloco.compress.errors import CompressionError
from muloco.compress.packing import pack_codes

GRANULARITIES = ("tensor", "row", "block")
LINEAR_MODES = ("absmax", "minmax")

# Default statistical range r (+-r standard deviations) per bits: the minimax choice over three row
# distributions (Gaussian; Gaussian with 0.1% of entries x20, our benchmark tensor; Student-t with 4 degrees
# of freedom): the r whose relative MSE is within the smallest factor of each distribution's best r
# (sweep in docs/compression.md). Wide at 8 bits (256 bins can afford to cover tails), tight at 2 bits.
# 1 bit: r does not matter (the two bins split at the mean and decode to the two half-means).
# For comparison, hivemind's Uniform8Bit uses +-3 std (RANGE_IN_SIGMAS = 6 is the full width).
DEFAULT_STAT_RANGE = {1: 1.0, 2: 2.0, 4: 3.75, 8: 10.0}

# Elements per chunk on the CPU: the quantize loop works on 4 MiB of fp32 at a time so that its
# intermediate values stay in cache, and per-chunk fp32 bin sums stay accurate (they are added in fp64).
# Larger chunks mean fewer parallel regions, which matters when other processes compete for the cores.
CPU_CHUNK = 1 << 20
# Group statistics outside these mean-square bounds are recomputed in fp64 (fp32 sums of squares overflow
# above ~1e19 per element and underflow below ~1e-19).
_SAFE_MEAN_SQUARE = (1e-30, 1e30)
BF16_MAX = 3.3895313892515355e38


@dataclass(frozen=True)
class Segment:
    """`rows` groups of `length` consecutive elements, starting at flat element `start`."""

    start: int
    rows: int
    length: int

    @property
    def numel(self) -> int:
        return self.rows * self.length


def segments(shape: tuple[int, ...], granularity: str, block_size: int) -> list[Segment]:
    """The groups of a tensor of `shape`, as at most two uniform segments (block: full blocks + the tail)."""
    n = math.prod(shape)
    if n == 0:
        return []
    if granularity == "tensor":
        return [Segment(0, 1, n)]
    if granularity == "row":
        rows = shape[0] if len(shape) >= 2 else 1
        return [Segment(0, rows, n // rows)]
    assert granularity == "block", f"{granularity=}"
    full, tail = divmod(n, block_size)
    out = [Segment(0, full, block_size)] if full else []
    if tail:
        out.append(Segment(full * block_size, 1, tail))
    return out


def num_groups(shape: tuple[int, ...], granularity: str, block_size: int) -> int:
    return sum(s.rows for s in segments(shape, granularity, block_size))


def linear_lut(bits: int, mode: str) -> torch.Tensor:
    """The levels of the linear quantizers, in units of step: (2**bits,) fp32."""
    j = torch.arange(2**bits, dtype=torch.float32)
    if mode == "minmax":
        return j
    if bits == 1:
        return j - 0.5  # mid-rise: +-step/2
    return j - (2 ** (bits - 1) - 1)  # mid-tread: j - qmax (the top code is never produced)


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 >= x, for finite x >= 0 (bf16 keeps the top 16 bits of the fp32 pattern)."""
    assert x.dtype == torch.float32, f"{x.dtype=}"
    bits = (x.contiguous().view(torch.int32) + 0xFFFF) >> 16  # ceil in magnitude; 0 stays 0
    return (bits.to(torch.int16)).view(torch.bfloat16)


@dataclass
class Quantized:
    """What a quantizer sends: codes plus per-group statistics (and the statistical lookup table)."""

    codes: torch.Tensor  # (n,) uint8, code < 2**bits, in flat element order
    steps: torch.Tensor  # (G,) bf16 >= 0
    offsets: torch.Tensor | None  # (G,) fp32; None for linear absmax
    lut: torch.Tensor  # (2**bits,) fp32, in units of step


def raise_non_finite(x: torch.Tensor) -> None:
    """Raise CompressionError naming how many NaN / Inf `x` holds; return if it holds none."""
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    if n_nan or n_inf:
        raise CompressionError(
            f"the tensor to compress holds {n_nan} NaN and {n_inf} Inf values (of {x.numel()} elements); "
            "compression needs finite values (did training diverge?)"
        )


def _finite_check(x2d: torch.Tensor, stat: torch.Tensor) -> None:
    """`stat` is a per-row reduction that is non-finite when its row holds NaN/Inf: check those rows."""
    bad = ~torch.isfinite(stat)
    if bool(bad.any()):
        raise_non_finite(x2d[bad])


def _stats_linear(x2d: torch.Tensor, bits: int, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row (step before rounding, offset) of the linear quantizers, fp32."""
    # amax / amin are vectorized reductions (~20x faster on the CPU than aminmax or an inf-norm) and both
    # propagate NaN; a NaN/Inf anywhere in a row makes that row's max or min non-finite.
    hi, lo = x2d.amax(dim=1), x2d.amin(dim=1)  # (rows,), (rows,)
    _finite_check(x2d, hi - lo)
    if mode == "absmax":
        qmax = 1 if bits == 1 else 2 ** (bits - 1) - 1
        return torch.maximum(hi, -lo) / qmax, None
    levels = 2**bits - 1
    return hi / levels - lo / levels, lo  # (hi - lo) / levels without overflowing


def _stats_statistical(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (mean, population std) in fp64: fast fp32 sums, fp64 two-pass where those are unsafe."""
    length = x2d.shape[1]
    total = x2d.sum(dim=1)  # (rows,) NaN/Inf iff the row holds NaN/Inf (or overflows)
    _finite_check(x2d, total)  # raises on NaN/Inf; a finite overflow is handled below
    norm = torch.linalg.vector_norm(x2d, dim=1)  # (rows,) fast, but over/underflows in fp32
    mean = total.double() / length
    mean_sq = norm.double().square() / length
    var = (mean_sq - mean.square()).clamp_(min=0)
    zero = norm == 0
    if bool(zero.any()):  # all-zero rows, or rows whose squares underflow
        zero &= (x2d.amax(dim=1) == 0) & (x2d.amin(dim=1) == 0)
        mean.masked_fill_(zero, 0)
        var.masked_fill_(zero, 0)
    lo, hi = _SAFE_MEAN_SQUARE
    unsafe = ~torch.isfinite(total) | ~torch.isfinite(norm) | (mean_sq > hi) | (mean_sq < lo) & ~zero
    unsafe |= var < 1e-5 * mean.square()  # cancellation in E[x^2] - E[x]^2: (near-)constant rows
    if bool(unsafe.any()):
        rows = x2d[unsafe].double()
        var_u, mean_u = torch.var_mean(rows, dim=1, correction=0)
        mean[unsafe], var[unsafe] = mean_u, var_u
    return mean, var.sqrt()


def _affine_params(
    step_f32: torch.Tensor, offset: torch.Tensor | None, kind: str, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round steps to bf16 and derive the encoder's per-row (inv, shift) that reproduce the decoder."""
    if not bool(torch.isfinite(step_f32).all()) or bool((step_f32 > BF16_MAX).any()):
        raise CompressionError(
            "values too large to quantize (their range overflows fp32/bf16 scales); "
            "scale the tensor down or use scheme none"
        )
    step = round_up_bf16(step_f32.abs())  # (rows,) bf16; abs: no -0.0
    s = step.float()
    # A step in fp32's subnormal range (a row of values ~1e-38, e.g. an error-feedback residual decayed
    # that far) has no finite 1/s: treat it as a zero step, so the row decodes to its offset (within
    # 1e-38 of every value) instead of turning u, and the statistical lookup table, into inf/NaN.
    inv = 1.0 / s
    inv = torch.where((s > 0) & torch.isfinite(inv), inv, torch.zeros_like(s))
    if kind == "absmax":
        shift = torch.full_like(s, 1.0 if bits == 1 else 2 ** (bits - 1) - 1 + 0.5)
        return step, inv, shift, None
    if kind == "minmax":
        off = offset.float()
        shift = 0.5 - off * inv
        return step, inv, shift, off
    # statistical: offset = mean - step * 2**(bits-1), so that u = (x - offset) / step lies in [0, 2**bits)
    # for x within +-r std; a zero-std row decodes to its mean whatever the table holds.
    off = (offset - s.double() * 2 ** (bits - 1)).float()
    shift = torch.where(inv > 0, -off * inv, torch.full_like(s, 2 ** (bits - 1) + 0.5))
    if not bool(torch.isfinite(off).all()):
        raise CompressionError(
            "values too large to quantize (the mean overflows fp32); scale the tensor down"
        )
    return step, inv, shift, off


def _row_chunks(seg: Segment, chunk: int):
    """Yield (row0, row1, col0, col1): pieces of a segment of about `chunk` elements."""
    if seg.length >= chunk:
        for r in range(seg.rows):
            for c in range(0, seg.length, chunk):
                yield r, r + 1, c, min(c + chunk, seg.length)
    else:
        per = max(1, chunk // seg.length)
        for r in range(0, seg.rows, per):
            yield r, min(r + per, seg.rows), 0, seg.length


class _BinStats:
    """Per-bin sums of u and counts of codes over a whole tensor, added chunk by chunk.

    torch.bincount is a serial loop on the CPU; there its two calls per chunk run on the worker pool and
    overlap the next chunk's (parallel) elementwise ops. Each call sums one chunk in fp32; chunks are
    added in fp64, which keeps the centroids accurate for any tensor size.
    """

    def __init__(self, levels: int, device: torch.device):
        self.levels = levels
        self.sum = torch.zeros(levels, dtype=torch.float64, device=device)
        self.count = torch.zeros(levels, dtype=torch.int64, device=device)
        threaded = device.type == "cpu" and torch.get_num_threads() > 1
        self.pool = _pool() if threaded else None
        self.pending: dict[int, tuple] = {}  # u buffer -> (sum job, count job)

    def add(self, buffer: int, codes: torch.Tensor, u: torch.Tensor) -> None:
        if self.pool is None:
            self.sum += torch.bincount(codes, weights=u, minlength=self.levels)
            self.count += torch.bincount(codes, minlength=self.levels)
            return
        self.pending[buffer] = (
            self.pool.submit(torch.bincount, codes, u, self.levels),
            self.pool.submit(torch.bincount, codes, None, self.levels),
        )

    def release(self, buffer: int) -> None:
        """Wait until the jobs reading `buffer` are done (before it is overwritten)."""
        jobs = self.pending.pop(buffer, None)
        if jobs is not None:
            self.sum += jobs[0].result()
            self.count += jobs[1].result()

    def centroids(self) -> torch.Tensor:
        """(levels,) fp32: the mean u of each bin; an empty bin gets its centre."""
        for buffer in list(self.pending):
            self.release(buffer)
        centre = torch.arange(self.levels, dtype=torch.float64, device=self.sum.device) + 0.5
        return torch.where(self.count > 0, self.sum / self.count.clamp(min=1), centre).float()


def quantize(
    x: torch.Tensor,
    bits: int,
    kind: str,
    granularity: str,
    block_size: int = 256,
    stat_range: float | None = None,
) -> Quantized:
    """Quantize `x` (any shape, fp32, contiguous) group-wise. `kind`: absmax | minmax | statistical."""
    assert x.dtype == torch.float32 and x.is_contiguous(), f"{x.dtype=}"
    flat = x.view(-1)
    n, levels = flat.numel(), 2**bits
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    chunk = CPU_CHUNK if x.device.type == "cpu" else 1 << 22
    r = DEFAULT_STAT_RANGE[bits] if stat_range is None else stat_range
    bins = _BinStats(levels, x.device) if kind == "statistical" else None
    steps, offsets = [], []
    # Two u buffers, alternating: the bin statistics of one chunk may still be reading one of them.
    u_bufs = [torch.empty(min(n, chunk), dtype=torch.float32, device=x.device) for _ in range(2)]
    f_buf = torch.empty_like(u_bufs[0]) if kind == "statistical" else None
    i = 0
    for seg in segments(tuple(x.shape), granularity, block_size):
        x2d = flat[seg.start : seg.start + seg.numel].view(seg.rows, seg.length)
        if kind == "statistical":
            mean, std = _stats_statistical(x2d)
            step_f32, offset = (std * (2 * r / levels)).float(), mean
        else:
            step_f32, offset = _stats_linear(x2d, bits, kind)
        step, inv, shift, off = _affine_params(step_f32, offset, kind, bits)
        steps.append(step)
        offsets.append(off)
        c2d = codes[seg.start : seg.start + seg.numel].view(seg.rows, seg.length)
        for r0, r1, c0, c1 in _row_chunks(seg, chunk):
            xs = x2d[r0:r1, c0:c1]  # (g, w)
            m, b = xs.numel(), i % 2
            i += 1
            if bins is not None:
                bins.release(b)
            u = u_bufs[b][:m].view(xs.shape)
            torch.mul(xs, inv[r0:r1, None], out=u)
            u.add_(shift[r0:r1, None])  # u = (x - offset) / step, in bin units
            # code = floor(u) clamped to [0, levels - 1]: clamp to [0, levels - 0.5], then the float -> uint8
            # conversion truncates, which is floor for u >= 0 (one op fewer than floor + clamp).
            cs = c2d[r0:r1, c0:c1]
            if kind == "statistical":
                f = f_buf[:m].view(xs.shape)
                cs.copy_(torch.clamp(u, 0, levels - 0.5, out=f))
                bins.add(b, cs.reshape(-1), u.view(-1))  # centroids from the unclamped u
            else:
                cs.copy_(u.clamp_(0, levels - 0.5))
    if bins is not None:
        lut = bins.centroids()
    else:
        lut = linear_lut(bits, kind).to(x.device)
    empty_f32 = torch.empty(0, dtype=torch.float32, device=x.device)
    return Quantized(
        codes=codes,
        steps=torch.cat(steps) if steps else torch.empty(0, dtype=torch.bfloat16, device=x.device),
        offsets=None if kind == "absmax" else (torch.cat(offsets) if offsets else empty_f32),
        lut=lut,
    )


def byte_table(lut: torch.Tensor, bits: int) -> np.ndarray:
    """(256, 8 // bits) fp32: the values of the codes packed in each possible byte (see packing.py)."""
    per = 8 // bits
    byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (byte >> shifts) & ((1 << bits) - 1)  # (256, per)
    return lut.cpu().float()[codes].numpy()


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (threads, pool), made on first use


def _pool() -> ThreadPoolExecutor:
    """Worker threads for the serial CPU steps (np.take, torch.bincount release the GIL), one per torch
    intra-op thread."""
    global _POOL
    threads = torch.get_num_threads()
    if _POOL is None or _POOL[0] != threads:
        _POOL = (threads, ThreadPoolExecutor(threads, thread_name_prefix="muloco-compress"))
    return _POOL[1]


def _parallel_take(table: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:
    """out[i] = table[packed[i]], split over torch's intra-op thread count (np.take releases the GIL).

    mode="clip": every uint8 is a valid row of the 256-row table, and numpy buffers `out` in the default
    mode="raise". Most of the time is first-touch page faults on the fresh output, which threads share.
    """
    threads = torch.get_num_threads()
    parts = min(4 * threads, packed.size // (1 << 18))
    if threads <= 1 or parts <= 1:
        np.take(table, packed, axis=0, out=out, mode="clip")
        return
    pool = _pool()
    bounds = np.linspace(0, packed.size, parts + 1).astype(np.int64)
    jobs = [
        pool.submit(np.take, table, packed[a:b], 0, out[a:b], "clip")
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    for job in jobs:
        job.result()


def dequantize(
    packed: np.ndarray,
    steps: torch.Tensor,
    offsets: torch.Tensor | None,
    lut: torch.Tensor,
    bits: int,
    shape: tuple[int, ...],
    granularity: str,
    block_size: int,
) -> torch.Tensor:
    """x_hat (fp32, `shape`, CPU) from packed codes (uint8 numpy) and the per-group statistics."""
    n = math.prod(shape)
    per = 8 // bits
    out = torch.empty(packed.size * per, dtype=torch.float32)
    # One table lookup per packed byte decodes `per` codes at once (no unpacking pass).
    table = lut.cpu().float().numpy() if bits == 8 else byte_table(lut, bits)
    _parallel_take(table, packed, out.numpy() if bits == 8 else out.numpy().reshape(packed.size, per))
    flat = out[:n]
    s_all, g = steps.float(), 0
    for seg in segments(shape, granularity, block_size):
        v = flat[seg.start : seg.start + seg.numel].view(seg.rows, seg.length)
        v.mul_(s_all[g : g + seg.rows, None])
        if offsets is not None:
            v.add_(offsets[g : g + seg.rows, None])
        g += seg.rows
    return flat.view(shape)


def dequantize_codes(q: Quantized, bits: int, shape, granularity: str, block_size: int) -> torch.Tensor:
    """x_hat straight from a `Quantized` (tests and error analysis; the wire path uses `dequantize`)."""
    packed = pack_codes(q.codes.cpu(), bits).numpy()
    offsets = None if q.offsets is None else q.offsets.cpu()
    return dequantize(
        packed, q.steps.cpu(), offsets, q.lut.cpu(), bits, tuple(shape), granularity, block_size
    )
