"""Which parameters sync when: fragments and their staggered schedule (Streaming DiLoCo).

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) splits the parameters into P fragments, each a
group of transformer blocks, and syncs one fragment at a time so that the peak bandwidth drops by ~P:

- `strided` (the paper's choice): block i joins fragment i mod P, so every fragment spans the depth.
- `sequential`: consecutive blocks, fragment p = blocks [p n/P, (p+1) n/P).
- Parameters outside the blocks: the ones before the first block (embeddings) join `embedding_fragment`,
  the ones after the last (final norm, head) join `head_fragment`.

Schedule (steps count completed inner steps, so "step s" is right after the s-th inner step): fragment p
starts its sync at every step s > 0 with s mod H == offset_p, offset_p = floor(p H / P). For P = 3, H = 30:
fragment 0 at 30, 60, 90, ...; fragment 1 at 10, 40, 70, ...; fragment 2 at 20, 50, 80, ... A sync started
at s is applied at s + tau (`sync.overlap`); the inner steps go on meanwhile. P = 1, tau = 0 is plain DiLoCo.
At the last step of the run every fragment with unsynced inner steps syncs once more, with tau = 0, so the
final global parameters hold every worker's work.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from muloco.sync.outer import OuterOptimizer

_BLOCK_INDEX = re.compile(r"(?:^|\.)(\d+)\.")


def block_index(name: str) -> int | None:
    """The transformer block a parameter belongs to: the first numeric path component
    (`blocks.3.attn.qkv.weight` -> 3), or None outside the blocks."""
    match = _BLOCK_INDEX.search(name)
    return int(match.group(1)) if match else None


def assign_fragments(
    names: Sequence[str],
    fragments: int,
    pattern: str = "strided",
    embedding_fragment: int = 0,
    head_fragment: int = -1,
) -> list[int]:
    """The fragment of every parameter, in `names` order. Raises ValueError when some fragment would be
    empty (fewer blocks than fragments)."""
    blocks = sorted({b for b in map(block_index, names) if b is not None})
    if fragments > 1 and len(blocks) < fragments:
        raise ValueError(
            f"sync.fragments ({fragments}) exceeds the model's {len(blocks)} blocks; "
            f"use sync.fragments <= {max(len(blocks), 1)}"
        )
    position = {b: i for i, b in enumerate(blocks)}  # block indices need not start at 0
    embedding_fragment %= fragments
    head_fragment %= fragments
    result, seen_block = [], False
    for name in names:
        b = block_index(name)
        if b is None:
            result.append(head_fragment if seen_block else embedding_fragment)
            continue
        seen_block = True
        i = position[b]
        result.append(i % fragments if pattern == "strided" else i * fragments // len(blocks))
    return result


def fragment_indices(names: Sequence[str], sync) -> list[list[int]]:
    """Parameter indices of each fragment for the `sync:` section (one fragment unless streaming)."""
    owner = assign_fragments(
        names, sync.fragments, sync.fragment_pattern, sync.embedding_fragment, sync.head_fragment
    )
    return [[i for i, p in enumerate(owner) if p == f] for f in range(sync.fragments)]


@dataclass(frozen=True)
class SyncSchedule:
    every: int  # H
    fragments: int = 1  # P
    overlap: int = 0  # tau

    def offset(self, fragment: int) -> int:
        return fragment * self.every // self.fragments

    def starting_at(self, step: int) -> list[int]:
        """Fragments whose sync starts right after inner step `step`."""
        if step <= 0:
            return []
        return [p for p in range(self.fragments) if step % self.every == self.offset(p)]

    def next_start(self, step: int) -> int:
        """The first step after `step` at which some fragment starts a sync."""
        s = step + 1
        while not self.starting_at(s):
            s += 1
        return s

    def table(self, steps: int) -> list[tuple[int, int, int]]:
        """(start step, fragment, apply step) of every scheduled sync up to `steps` (docs and tests)."""
        return [(s, p, s + self.overlap) for s in range(1, steps + 1) for p in self.starting_at(s)]


@dataclass
class Fragment:
    """One of the P groups of parameters that sync together (P = 1: the whole model), with what its syncs
    need: its rows of the fp32 global parameters and of the outer momentum (the outer step is elementwise,
    so these are its own outer state), its codec (None: fp32 sums), its slot in the schedule, and whether
    the replicas took inner steps that no started sync of it covers yet. Error feedback is kept per
    replica, keyed by parameter name: a fragment's residuals are those of its `names`."""

    index: int  # p, of P
    indices: list[int]  # its parameters' positions in the model's parameter list
    outer: OuterOptimizer = field(repr=False)
    codec: Any = None  # PseudogradientCodec, or PartitionedCodec (reduce_scatter); None: fp32
    offset: int = 0  # it starts a sync at every step s > 0 with s mod H == offset
    unsynced: bool = False

    @property
    def whole(self) -> bool:
        """The fragment is the whole model (plain DiLoCo)."""
        return len(self.indices) == len(self.outer.params)

    @property
    def names(self) -> list[str]:
        return [self.outer.names[i] for i in self.indices]

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.outer.params[i] for i in self.indices]

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def outer_step(self, mean: list[torch.Tensor]) -> float:
        """The outer Nesterov step on the fragment's global parameters; the update's norm."""
        return self.outer.step(mean, None if self.whole else self.indices)
