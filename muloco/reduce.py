"""Averaging pseudogradients over the healthy replicas at a sync: the collectives every process must call,
in the same order (the local backend completes at once; torch.distributed waits up to
backend.torch.timeout_s).

`start_*` return a `PendingMean` whose `wait()` gives a `Mean`: the average over the replicas that
contributed (a replica with a non-finite pseudogradient sends nothing: docs/reliability.md) and how many
did, summed over all processes. Streaming DiLoCo starts a sync, keeps training for tau inner steps and only
then waits. Used by the trainer (k replicas per process) and by `muloco.DiLoCo` (one replica per process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from muloco.codec import PseudogradientCodec, pack
from muloco.comm import Backend, CompletedHandle, Handle


class Mean(NamedTuple):
    values: list[torch.Tensor] | None  # None when no replica contributed
    contributors: int
    left_out: int | None = None  # replicas excluded (hivemind: group members dropped); None: K - contributors
    group_size: int | None = None  # hivemind: peers in the group, this one included


class PendingMean:
    """A started reduction; `wait()` blocks until it is done and returns the Mean (computed once, kept)."""

    def __init__(self, handle: Handle, finish: Callable[[object], Mean]) -> None:
        self._handle, self._finish = handle, finish
        self._result: Mean | None = None

    def wait(self) -> Mean:
        if self._result is None:
            self._result = self._finish(self._handle.wait())
            self._handle = None  # drop the transfer buffers
        return self._result


def start_mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], contributors: int = 1
) -> PendingMean:
    """fp32: one all-reduce (sum) of this process's sum over its `contributors` healthy replicas, with the
    count riding along in the same buffer, then / the total count. Overwrites local_sum."""
    count = torch.tensor([float(contributors)], dtype=local_sum[0].dtype, device=local_sum[0].device)
    handle = backend.all_reduce_sum([*local_sum, count])

    def finish(total: list[torch.Tensor]) -> Mean:
        n = int(round(total[-1].item()))
        return Mean([t.div_(n) for t in total[:-1]] if n > 0 else None, n)

    return PendingMean(handle, finish)


def start_mean_compressed(
    backend: Backend,
    codec: PseudogradientCodec,
    messages: list[bytes],
    max_replicas: int,
    like: list[torch.Tensor],
) -> PendingMean:
    """Compressed: all-gather every process's messages (one per healthy replica); every process decodes all
    of them in replica order and averages, so all processes (and the simulation) hold the same mean, bit
    for bit."""
    handle = backend.all_gather_bytes(pack(messages))

    def finish(blobs: list[bytes]) -> Mean:
        values, seen = codec.decode_mean(blobs, max_replicas, like)
        return Mean(values, seen)

    return PendingMean(handle, finish)


def share_with_worker(worker: Backend, pending: PendingMean | None, like: list[torch.Tensor]) -> PendingMean:
    """A worker of R ranks (docs/topology.md): its lead rank (pending is its mean across workers; None on
    the other ranks) broadcasts the mean and the contributor count to the worker's ranks when waited for."""

    def finish(_) -> Mean:
        if pending is not None:
            mean = pending.wait()
            values = mean.values or [torch.zeros_like(t) for t in like]
            count = torch.tensor([float(mean.contributors)], device=like[0].device)
        else:
            values, count = [torch.empty_like(t) for t in like], torch.zeros(1, device=like[0].device)
        *values, count = worker.broadcast([*values, count], src=0).wait()
        n = int(count.item())
        return Mean(values if n > 0 else None, n)

    return PendingMean(CompletedHandle(None), finish)


def mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], num_replicas: int
) -> list[torch.Tensor]:
    """The mean when every one of the `num_replicas` replicas contributes (the Python API's case)."""
    mean = start_mean_uncompressed(backend, local_sum, num_replicas // backend.world_size).wait()
    assert mean.contributors == num_replicas, f"{mean.contributors=} != {num_replicas=}"
    return mean.values


def mean_compressed(
    backend: Backend,
    codec: PseudogradientCodec,
    messages: list[bytes],
    num_replicas: int,
    like: list[torch.Tensor],
) -> list[torch.Tensor]:
    mean = start_mean_compressed(backend, codec, messages, num_replicas, like).wait()
    assert mean.contributors == num_replicas, f"{mean.contributors=} != {num_replicas=}"
    return mean.values
