"""Part ownership for the reduce-scatter transport: a fragment's tensors cut into K parts along whole rows.

A tensor's rows are its leading dimension (the row-wise quantizers' rows: the tensor viewed as
(shape[0], -1)); a 0-D or 1-D tensor is one row, so it is never cut. The tensors' rows, in order, are cut at
the cumulative costs j C / K (C: the fragment's total bytes on the wire), so each of the K parts holds a
contiguous run of rows worth ~C / K bytes, every row in exactly one part. A part is a list of `Piece`s (row
ranges of one tensor each). The cut depends only on the shapes and the costs, so every process computes
the same parts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    tensor: int  # position in the fragment's tensor list
    start: int  # first row
    stop: int  # one past the last row

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece's rows of `t` (a view; the whole tensor when it is 0-D or 1-D)."""
        return t if t.dim() < 2 else t[self.start : self.stop]

    def shape(self, full: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this piece of a tensor of shape `full`."""
        return tuple(full) if len(full) < 2 else (self.stop - self.start, *full[1:])

    def key(self, name: str) -> str:
        """An error-feedback buffer's name for this piece of parameter `name`."""
        return f"{name}[{self.start}:{self.stop}]"


def row_count(shape: torch.Size | tuple[int, ...]) -> int:
    return int(shape[0]) if len(shape) >= 2 else 1


def assign_parts(shapes: list[torch.Size], costs: list[float], parts: int) -> list[list[Piece]]:
    """K = `parts` lists of pieces covering every row of every tensor once; `costs[i]` is tensor i's bytes
    (spread evenly over its rows). Row r of tensor i goes to part floor(K x midpoint / C), the midpoint being
    the row's centre on the cumulative cost axis, so a part exceeds C / K by at most one row's cost."""
    assert len(shapes) == len(costs) and parts >= 1, f"{len(shapes)=} {len(costs)=} {parts=}"
    total = float(sum(costs))
    owned: list[list[Piece]] = [[] for _ in range(parts)]
    before = 0.0
    for i, (shape, cost) in enumerate(zip(shapes, costs, strict=True)):
        rows = row_count(shape)
        per_row = cost / rows if rows else 0.0

        def part_of_row(r: int, before: float = before, per_row: float = per_row) -> int:
            return _part_of(before + (r + 0.5) * per_row, total, parts)

        start = 0
        while start < rows:  # one piece per part the tensor's rows fall in (parts are non-decreasing)
            part = part_of_row(start)
            stop = bisect.bisect_right(range(rows), part, lo=start, key=part_of_row)
            owned[part].append(Piece(i, start, stop))
            start = stop
        before += cost
    return owned


def _part_of(position: float, total: float, parts: int) -> int:
    return 0 if total <= 0 else min(parts - 1, int(position * parts / total))


__all__ = ["Piece", "assign_parts", "row_count"]
