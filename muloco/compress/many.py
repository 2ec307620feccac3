"""Many small tensors quantized (and dequantized) in one pass, with the bytes `quantize` gives each alone.

A sync sends one payload per tensor (or per piece of a tensor under reduce-scatter): 20-100 of them at pico,
most a few thousand elements, where the ~40 torch calls per tensor of quantize.py cost far more than the
arithmetic (a 0.19M-parameter model spent ~1 ms per tensor). Here the groups of every small tensor that share
a group length are stacked into one (rows, length) matrix and quantize.py's per-group arithmetic runs on it
once. Every step is per group, per element, or a per-tensor bin sum taken in the tensor's own element order,
so the codes, statistics and tables are bit for bit those of `quantize` on each tensor alone (tested).

Large tensors (> BATCH_MAX elements) go through `quantize` / `dequantize` one by one: their arithmetic dwarfs
the Python around it, and ATen may split one long row's reduction over threads (another summation order).
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from muloco.compress.quantize import (
    DEFAULT_STAT_RANGE,
    Quantized,
    _affine_params,
    _stats_linear,
    _stats_statistical,
    linear_lut,
    quantize,
    segments,
)

# Tensors of up to 32K elements are batched. ATen splits a reduction over threads only past its grain size
# (32,768 elements, at::internal::GRAIN_SIZE), so up to it each row reduces in one order, batched or not.
BATCH_MAX = 1 << 15


def is_batched(x: torch.Tensor) -> bool:
    return 0 < x.numel() <= BATCH_MAX and x.device.type == "cpu"


def quantize_many(
    xs: list[torch.Tensor],
    bits: int,
    kind: str,
    granularity: str,
    block_size: int = 256,
    stat_range: float | None = None,
    with_values: bool = False,
) -> tuple[list[Quantized], list[torch.Tensor] | None]:
    """`quantize` of each of `xs` (fp32, contiguous), and, with `with_values`, what the decoder will make of
    each (x_hat, fp32, its shape; None for the large tensors, which the caller decodes itself)."""
    out: list[Quantized | None] = [None] * len(xs)
    values: list[torch.Tensor | None] = [None] * len(xs)
    small = [i for i, x in enumerate(xs) if is_batched(x)]
    for i, x in enumerate(xs):
        if not is_batched(x):
            out[i] = quantize(x, bits, kind, granularity, block_size, stat_range)
    if small:
        _quantize_small(xs, small, bits, kind, granularity, block_size, stat_range, out, values)
    return out, (values if with_values else None)


def _quantize_small(xs, small, bits, kind, granularity, block_size, stat_range, out, values) -> None:
    levels = 2**bits
    r = DEFAULT_STAT_RANGE[bits] if stat_range is None else stat_range
    segs = {i: segments(tuple(xs[i].shape), granularity, block_size) for i in small}
    by_length: dict[int, list[tuple[int, int]]] = defaultdict(list)  # length -> [(slot, segment index)]
    for s, i in enumerate(small):
        for k, seg in enumerate(segs[i]):
            by_length[seg.length].append((s, k))
    statistical = kind == "statistical"
    bin_sum = torch.zeros(len(small) * levels, dtype=torch.float64) if statistical else None
    bin_count = torch.zeros(len(small) * levels, dtype=torch.int64) if statistical else None
    groups = []  # per length: (members, rows per member, codes, step, offset, owner slot per row)
    for length, members in by_length.items():
        rows = [segs[small[s]][k] for s, k in members]
        flat = [
            xs[small[s]].view(-1)[g.start : g.start + g.numel]
            for (s, _), g in zip(members, rows, strict=True)
        ]
        x2d = torch.cat(flat).view(-1, length)  # (R, length): every member's groups, in member order
        if statistical:
            mean, std = _stats_statistical(x2d)
            step_f32, offset = (std * (2 * r / levels)).float(), mean
        else:
            step_f32, offset = _stats_linear(x2d, bits, kind)
        step, inv, shift, off = _affine_params(step_f32, offset, kind, bits)
        u = torch.mul(x2d, inv[:, None])
        u.add_(shift[:, None])  # as quantize: u = (x - offset) / step, in bin units
        codes = torch.clamp(u, 0, levels - 0.5).to(torch.uint8)
        counts = [g.rows for g in rows]
        if statistical:  # each tensor its own table: a code's bin is (its tensor, the code)
            owner = torch.repeat_interleave(torch.tensor([s for s, _ in members]), torch.tensor(counts))
            index = (owner[:, None] * levels + codes).view(-1)
            # One serial bincount: each bin still sums its own tensor's u in element order (see quantize).
            bin_sum += torch.bincount(index, weights=u.view(-1), minlength=bin_sum.numel())
            bin_count += torch.bincount(index, minlength=bin_count.numel())
        else:  # one table for every tensor: the linear levels
            index = codes.view(-1).long()
        groups.append((members, counts, codes, step, off, index))
    luts = _luts(bits, kind, bin_sum, bin_count, len(small))  # (T, levels)
    parts: dict[tuple[int, int], tuple] = {}  # (slot, segment) -> (codes, step, offset, x_hat) rows
    table = luts.reshape(-1) if statistical else luts[0]
    for members, counts, codes, step, off, index in groups:
        # x_hat as `dequantize` computes it: lut[code] * step, then + offset, in fp32
        x_hat = table[index].view(codes.shape)
        x_hat.mul_(step.float()[:, None])
        if off is not None:
            x_hat.add_(off[:, None])
        row0 = 0
        for member, n in zip(members, counts, strict=True):
            sl = slice(row0, row0 + n)
            parts[member] = (codes[sl], step[sl], None if off is None else off[sl], x_hat[sl])
            row0 += n
    for s, i in enumerate(small):
        pieces = [parts[(s, k)] for k in range(len(segs[i]))]
        out[i] = Quantized(
            codes=_joined([p[0] for p in pieces]),
            steps=_joined([p[1] for p in pieces]),
            offsets=None if kind == "absmax" else _joined([p[2] for p in pieces]),
            lut=luts[s],
        )
        values[i] = _joined([p[3] for p in pieces]).view(xs[i].shape)


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces flattened end to end (a view where there is one)."""
    return pieces[0].reshape(-1) if len(pieces) == 1 else torch.cat([p.reshape(-1) for p in pieces])


def _luts(bits: int, kind: str, bin_sum, bin_count, tensors: int) -> torch.Tensor:
    """(tensors, 2**bits) fp32: each tensor's lookup table (quantize's centroids, or the linear levels)."""
    levels = 2**bits
    if bin_sum is None:
        return linear_lut(bits, kind).expand(tensors, levels)
    centre = (torch.arange(levels, dtype=torch.float64) + 0.5).repeat(tensors)
    lut = torch.where(bin_count > 0, bin_sum / bin_count.clamp(min=1), centre).float()
    return lut.view(tensors, levels)


def dequantize_many(
    items: list[tuple[np.ndarray, torch.Tensor, torch.Tensor | None, torch.Tensor, tuple[int, ...]]],
    bits: int,
    granularity: str,
    block_size: int,
) -> list[torch.Tensor]:
    """`dequantize` of many small payloads' sections at once: each item is (packed codes, steps fp32,
    offsets fp32 or None, lut fp32, shape). One table lookup for every packed byte of every item, then
    one multiply (and add) by the per-element step (and offset)."""
    per = 8 // bits
    byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    codes_of_byte = (byte >> (torch.arange(per, dtype=torch.int64) * bits)) & ((1 << bits) - 1)  # (256, per)
    tables = torch.stack([lut.float() for _, _, _, lut, _ in items])[:, codes_of_byte]  # (T, 256, per)
    packed = [p for p, _, _, _, _ in items]
    base = np.repeat(np.arange(len(items), dtype=np.int64) * 256, [p.size for p in packed])
    index = np.concatenate(packed).astype(np.int64) + base
    looked_up = torch.from_numpy(np.take(tables.numpy().reshape(-1, per), index, axis=0)).view(-1)
    numels = [math.prod(shape) for *_, shape in items]
    starts = np.cumsum([0] + [p.size * per for p in packed[:-1]])
    flat = torch.cat([looked_up[s : s + n] for s, n in zip(starts.tolist(), numels, strict=True)])
    seg_rows, seg_lengths = [], []
    for *_, shape in items:
        for seg in segments(tuple(shape), granularity, block_size):
            seg_rows.append(seg.rows)
            seg_lengths.append(seg.length)
    group_lengths = torch.repeat_interleave(torch.tensor(seg_lengths), torch.tensor(seg_rows))
    flat.mul_(torch.repeat_interleave(torch.cat([s for _, s, _, _, _ in items]), group_lengths))
    if items[0][2] is not None:
        flat.add_(torch.repeat_interleave(torch.cat([o for _, _, o, _, _ in items]), group_lengths))
    return [v.view(shape) for v, (*_, shape) in zip(torch.split(flat, numels), items, strict=True)]


__all__ = ["BATCH_MAX", "dequantize_many", "is_batched", "quantize_many"]
