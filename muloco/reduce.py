"""Averaging pseudogradients over all K replicas at a sync: the collectives every process must call, in the
same order (the local backend completes at once; torch.distributed waits up to backend.torch.timeout_s).

`start_*` return a `PendingMean` whose `wait()` gives the mean: Streaming DiLoCo starts a sync, keeps
training for tau inner steps and only then waits. Used by the trainer (k replicas per process) and by
`muloco.DiLoCo` (one replica per process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from muloco.codec import PseudogradientCodec, pack
from muloco.comm import Backend, CompletedHandle, Handle


class PendingMean:
    """A started reduction; `wait()` blocks until it is done and returns the mean (once computed, kept)."""

    def __init__(self, handle: Handle, finish: Callable[[object], list[torch.Tensor]]) -> None:
        self._handle, self._finish = handle, finish
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._finish(self._handle.wait())
            self._handle = None  # drop the transfer buffers
        return self._result


def start_mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], num_replicas: int
) -> PendingMean:
    """fp32: one all-reduce (sum) of this process's replica sum, then / K. Overwrites local_sum."""
    handle = backend.all_reduce_sum(local_sum)
    return PendingMean(handle, lambda total: [t.div_(num_replicas) for t in total])


def start_mean_compressed(
    backend: Backend,
    codec: PseudogradientCodec,
    messages: list[bytes],
    num_replicas: int,
    like: list[torch.Tensor],
) -> PendingMean:
    """Compressed: all-gather every process's replica messages; every process decodes all of them in replica
    order and averages, so all processes (and the simulation) hold the same mean, bit for bit."""
    handle = backend.all_gather_bytes(pack(messages))
    return PendingMean(handle, lambda blobs: codec.decode_mean(blobs, num_replicas, like))


def share_with_worker(worker: Backend, pending: PendingMean | None, like: list[torch.Tensor]) -> PendingMean:
    """A worker of R ranks (docs/topology.md): its lead rank (pending is its mean across workers; None on
    the other ranks) broadcasts the mean to the worker's ranks when it is waited for."""

    def finish(_) -> list[torch.Tensor]:
        mean = pending.wait() if pending is not None else [torch.empty_like(t) for t in like]
        return worker.broadcast(mean, src=0).wait()

    return PendingMean(CompletedHandle(None), finish)


def mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], num_replicas: int
) -> list[torch.Tensor]:
    return start_mean_uncompressed(backend, local_sum, num_replicas).wait()


def mean_compressed(
    backend: Backend,
    codec: PseudogradientCodec,
    messages: list[bytes],
    num_replicas: int,
    like: list[torch.Tensor],
) -> list[torch.Tensor]:
    return start_mean_compressed(backend, codec, messages, num_replicas, like).wait()
