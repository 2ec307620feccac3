"""How the contributions of one sync become the pseudogradient the outer step applies (sync.aggregate).

Every rule is deterministic and sees the contributions in one fixed order (replica index, or peer id in a
swarm), so every member that holds the same contributions computes the same bytes.

- mean:          the plain mean; no tolerance for a bad member (one can move it arbitrarily).
- sender_mean:   per coordinate, the mean over the contributions that sent it (decode nonzero), 0 where
                 none did: SparseLoCo's aggregate of sparse parts (Sarfi et al. 2025, arXiv 2508.15706; its
                 code's scatter_reduce "mean" with include_self=False), so an entry only one worker kept is
                 not shrunk K-fold. A kept value of exactly 0 counts as not sent here (it adds nothing to the
                 sum; the reference would count it); dense contributions give the plain mean. No tolerance.
- trimmed_mean:  per coordinate, drop the f largest and f smallest values and average the rest (f =
                 sync.trim, at most (n - 1) // 2 of n): tolerates f bad members (Yin et al. 2018,
                 "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates").
- median:        per coordinate (the mean of the two middle values for an even n): tolerates
                 (n - 1) // 2 bad members, at the highest cost in noise when all are honest.
- centered_clip: start at the coordinate-wise median v, then CLIP_ITERATIONS times
                 v <- v + mean_i(clip_tau(x_i - v)), clipping each member's whole tensor to norm tau,
                 with tau the median distance of the members to v (Karimireddy, He, Jaggi 2021, "Learning
                 from History for Byzantine Robust Optimization"; the adaptive tau is ours): a bad member
                 moves v by at most tau / n per iteration, whatever it sends.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregate = Literal["mean", "sender_mean", "trimmed_mean", "median", "centered_clip"]
ROBUST: tuple[str, ...] = ("trimmed_mean", "median", "centered_clip")  # they tolerate bad members
AGGREGATES: tuple[str, ...] = ("mean", "sender_mean", *ROBUST)
CLIP_ITERATIONS = 3  # Karimireddy et al. show a single iteration suffices from a good start; 3 is cheap
SORTING_NETWORK_MAX = 16  # the network's n^2 / 2 elementwise steps beat torch.sort up to here


def aggregate(
    contributions: list[list[torch.Tensor]], rule: str = "mean", trim: int = 1
) -> list[torch.Tensor]:
    """One tensor per parameter: the contributions (each a list of tensors, in the caller's fixed order)
    combined by `rule`. New tensors; the inputs are not modified."""
    if not contributions:
        raise ValueError("aggregate needs at least one contribution")
    if rule not in AGGREGATES:
        raise ValueError(f"unknown aggregate {rule!r}: use one of {', '.join(AGGREGATES)}")
    if rule == "mean" or len(contributions) == 1:
        return _mean(contributions)
    if rule == "sender_mean":
        return [_sender_mean(list(values)) for values in zip(*contributions, strict=True)]
    out = []
    for values in zip(*contributions, strict=True):
        if rule == "trimmed_mean":
            out.append(_trimmed_mean(list(values), trim))
        elif rule == "median":
            out.append(_median(_sorted(values)))
        else:
            out.append(_centered_clip(list(values)))
    return out


def tolerated(rule: str, trim: int) -> int:
    """Bad members `rule` tolerates: sync.trim for the robust rules, none for the means."""
    return trim if rule in ROBUST else 0


def robust_minimum(trim: int) -> int:
    """The fewest contributions among which trimmed_mean still drops `trim` at each end and keeps one:
    2 x trim + 1 (Yin et al. 2018's condition for tolerating `trim` bad ones)."""
    return 2 * trim + 1


def trimmed_per_side(n: int, trim: int) -> int:
    """How many values trimmed_mean drops at each end of n: trim, but always keeping at least one."""
    return max(0, min(trim, (n - 1) // 2))


def _mean(contributions: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    total = [t.clone() for t in contributions[0]]
    for tensors in contributions[1:]:
        torch._foreach_add_(total, list(tensors))
    return [t.div_(len(contributions)) for t in total]


def _sender_mean(values: list[torch.Tensor]) -> torch.Tensor:
    total, senders = values[0].clone(), (values[0] != 0).to(values[0].dtype)
    for v in values[1:]:
        total.add_(v)
        senders.add_((v != 0).to(senders.dtype))
    return total.div_(senders.clamp_(min=1))


def _sorted(values) -> list[torch.Tensor]:
    """The values sorted per coordinate (new tensors): row i holds each coordinate's i-th smallest value.
    Exact, so the result does not depend on the order of the values. Up to SORTING_NETWORK_MAX values,
    an odd-even transposition network of elementwise min / max (3-4x faster than torch.sort along a
    short dimension on CPU, bench_aggregate.py); beyond, torch.sort."""
    n = len(values)
    if n > SORTING_NETWORK_MAX:
        return list(torch.stack(list(values)).sort(dim=0).values.unbind(0))
    rows = [v.clone() for v in values]
    spare = torch.empty_like(rows[0])
    for phase in range(n):  # n phases of compare-exchange sort n values (Knuth, TAOCP 5.3.4)
        for j in range(phase % 2, n - 1, 2):
            torch.minimum(rows[j], rows[j + 1], out=spare)
            torch.maximum(rows[j], rows[j + 1], out=rows[j + 1])
            rows[j], spare = spare, rows[j]
    return rows


def _sum_in_order(rows: list[torch.Tensor]) -> torch.Tensor:
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


def _trimmed_mean(values: list[torch.Tensor], trim: int) -> torch.Tensor:
    n = len(values)
    f = trimmed_per_side(n, trim)
    rows = _sorted(values)  # also when f == 0: the sum in sorted order does not depend on the caller's
    return _sum_in_order(rows[f : n - f]).div_(n - 2 * f)


def _median(rows: list[torch.Tensor]) -> torch.Tensor:
    n = len(rows)
    if n % 2:
        return rows[n // 2].clone()
    return (rows[n // 2 - 1] + rows[n // 2]).div_(2)


def _centered_clip(values: list[torch.Tensor]) -> torch.Tensor:
    n = len(values)
    center = _median(_sorted(values))
    for _ in range(CLIP_ITERATIONS):
        offsets = [v - center for v in values]
        distances = torch.stack([torch.linalg.vector_norm(o) for o in offsets])
        tau = distances.sort().values[(n - 1) // 2]  # the lower median distance
        if float(tau) == 0.0:
            break  # most members sit on the center already
        scales = torch.clamp(tau / distances.clamp_min(1e-30), max=1.0)
        step = _sum_in_order([o.mul_(scale) for o, scale in zip(offsets, scales, strict=True)])
        center = center + step.div_(n)
    return center
