"""The chunks of chunked top-k: where each chunk lies in a tensor and how many of its entries are kept.

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) keeps the top k of every chunk rather than of the whole
tensor, so an index needs only log2(chunk) bits and every region of a matrix gets its share. Its authors'
code (tplr/sparseloco.py, the initial commit) cuts each dimension into runs of its largest divisor at most
a target side (64): a matrix into tiles of up to 64 x 64 = 4,096 entries, a vector into runs of up to 64,
with no padding. Tensors of 3+ dims are seen as (shape[0], the rest), as the row quantizers see them. Each
chunk keeps max(1, round(chunk_len x fraction)) entries (the code's max(1, round(len x top_k / 4096))).

Pure functions of the shape and the side: the wire format checks a payload's geometry with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n that is <= limit (1 if none larger): a run length that tiles n exactly."""
    for d in range(min(n, limit), 1, -1):
        if n % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class Tiling:
    """A tensor seen as a (rows, cols) matrix cut into tiles of (tile_rows, tile_cols)."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int

    @property
    def chunk_len(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def chunks(self) -> int:
        return (self.rows // self.tile_rows) * (self.cols // self.tile_cols) if self.rows * self.cols else 0


def tiling(shape: tuple[int, ...], side: int) -> Tiling:
    """The chunks of a tensor of `shape` for tiles of at most `side` x `side` (vectors: runs of `side`)."""
    n = math.prod(shape)
    if n == 0:
        return Tiling(0, 0, 1, 1)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = n // rows
    tile_rows = largest_divisor_at_most(rows, side) if len(shape) >= 2 else 1
    return Tiling(rows, cols, tile_rows, largest_divisor_at_most(cols, side))


def kept_per_chunk(chunk_len: int, fraction: float) -> int:
    """Entries each chunk keeps: max(1, round(chunk_len x fraction)) (Python's round, as the reference),
    at most the chunk."""
    return max(1, min(chunk_len, round(chunk_len * fraction)))


def to_chunks(x: torch.Tensor, t: Tiling) -> torch.Tensor:
    """(chunks, chunk_len): each row one tile's entries in row-major order (a copy)."""
    r, c = t.rows // t.tile_rows, t.cols // t.tile_cols
    tiles = x.reshape(r, t.tile_rows, c, t.tile_cols).permute(0, 2, 1, 3)
    return tiles.reshape(r * c, t.chunk_len)


def from_chunks(chunks: torch.Tensor, t: Tiling, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `to_chunks`: the tensor of `shape` (a copy)."""
    r, c = t.rows // t.tile_rows, t.cols // t.tile_cols
    tiles = chunks.reshape(r, c, t.tile_rows, t.tile_cols).permute(0, 2, 1, 3)
    return tiles.reshape(shape).contiguous()
