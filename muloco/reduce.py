"""Averaging pseudogradients over all K replicas at a sync: the collectives every process must call, in the
same order (the local backend returns at once; torch.distributed waits up to backend.torch.timeout_s).

Used by the trainer (k replicas per process) and by `muloco.DiLoCo` (one replica per process).
"""

from __future__ import annotations

import torch

from muloco.codec import PseudogradientCodec, pack
from muloco.comm import Backend


def mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], num_replicas: int
) -> list[torch.Tensor]:
    """fp32: one all-reduce (sum) of this process's replica sum, then / K. Overwrites local_sum."""
    total = backend.all_reduce_sum(local_sum).wait()
    return [t.div_(num_replicas) for t in total]


def mean_compressed(
    backend: Backend,
    codec: PseudogradientCodec,
    messages: list[bytes],
    num_replicas: int,
    like: list[torch.Tensor],
) -> list[torch.Tensor]:
    """Compressed: all-gather every process's replica messages; every process decodes all of them in replica
    order and averages, so all processes (and the simulation) hold the same mean, bit for bit."""
    blobs = backend.all_gather_bytes(pack(messages)).wait()
    return codec.decode_mean(blobs, num_replicas, like)
