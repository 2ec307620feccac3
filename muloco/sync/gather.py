"""This process's part of one fragment's sync, as the engine gathers it from its replicas: the healthy
replicas' pseudogradients summed (fp32) or encoded one message each (compressed), their norms, and the sum
of their unit vectors, which gives the mean pairwise cosine. A replica whose loss or pseudogradient is not
finite sits the sync out and restarts from the global parameters (guard.py)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from muloco.sync.guard import usable

log = logging.getLogger("muloco")


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors taken as one vector (one host sync, not one per tensor)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).item()


@dataclass
class Gathered:
    like: list[torch.Tensor]  # the fragment's global parameters
    compressed: bool
    with_cosine: bool  # more than one local replica
    norms: list[float] = field(default_factory=list)  # of the healthy replicas' pseudogradients
    messages: list[bytes] = field(default_factory=list)  # compressed: one per healthy replica
    delta_sum: list[torch.Tensor] | None = None  # fp32: their sum
    unit_sum: list[torch.Tensor] | None = None  # the sum of delta_k / |delta_k|

    def __post_init__(self) -> None:
        if not self.compressed:
            self.delta_sum = [torch.zeros_like(p) for p in self.like]
        if self.with_cosine:
            self.unit_sum = [torch.zeros_like(p) for p in self.like]

    def add(self, delta: list[torch.Tensor], norm: float) -> None:
        """One healthy replica's pseudogradient (its message, compressed, is the caller's to append:
        encoding with error feedback may change `delta`, so it comes after)."""
        self.norms.append(norm)
        if self.unit_sum is not None:
            torch._foreach_add_(self.unit_sum, delta, alpha=1.0 / max(norm, 1e-30))
        if not self.compressed:
            torch._foreach_add_(self.delta_sum, delta)

    @property
    def healthy(self) -> int:
        return len(self.norms)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.like)

    def payload_bytes(self) -> float:
        """One replica's message: 4 x numel uncompressed, else the mean encoded length."""
        if not self.compressed:
            return 4.0 * self.numel
        return sum(map(len, self.messages)) / len(self.messages) if self.messages else 0.0

    def cosine(self) -> float | None:
        """The mean pairwise cosine of the healthy replicas' pseudogradients: with unit vectors u,
        sum_{j != k} u_j . u_k = |sum u|^2 - n."""
        n = self.healthy
        if self.unit_sum is None or n < 2:
            return None
        return (global_norm(self.unit_sum) ** 2 - n) / (n * (n - 1))


def gather(part, replicas: list, step: int, engine) -> Gathered:
    """Each replica's pseudogradient delta_k = theta_global - theta_k of fragment `part` (fragments.py).
    Uncompressed: summed over this process's replicas. Compressed: each replica encodes its own message
    with its own error feedback, exactly what a node would send. `engine`: the global parameters, the
    error-feedback buffers, the worker's ranks (sharded) and the diagnostics observer."""
    gathered = Gathered(part.params, compressed=part.codec is not None, with_cosine=len(replicas) > 1)
    for position, replica in enumerate(replicas):
        replica.activate()
        base = engine.base_of(position)  # the global parameters (eager updates: the worker's own)
        delta = replica.pseudogradient(base, part.indices)
        if engine.contribution_weight is not None:  # its share of the round's tokens, x K
            torch._foreach_mul_(delta, engine.contribution_weight(replica.index, step))
        norm = global_norm(delta)
        if engine.shard_group is not None:  # every rank of the worker judges the replica alike
            sq, unhealthy = engine.worker_sum(norm**2, float(not replica.healthy))
            norm, replica.healthy = math.sqrt(sq), unhealthy == 0
        if not usable(replica, norm):
            _reset(replica, base, engine.error_feedback[position], step, norm)
            continue
        gathered.add(delta, norm)
        if engine.eager is not None:
            engine.eager.keep(position, delta)
        if part.codec is not None:
            gathered.messages.append(part.codec.encode(delta, engine.error_feedback[position]))
        if engine.observer is not None:
            engine.observer.observe(delta)
        del delta
        replica.deactivate()
    return gathered


def _reset(replica, global_params: list[torch.Tensor], feedback, step: int, norm: float) -> None:
    """Left out of this sync (the mean is over the healthy replicas) and restarted from the global
    parameters with a fresh inner state and error-feedback buffer (they may hold the NaN)."""
    log.warning(
        "replica=%d step=%d: non-finite loss or pseudogradient (norm %s): left out of this sync and "
        "reset to the parameters its window started from",
        replica.index,
        step,
        norm,
    )
    replica.reset_to(global_params)
    if feedback is not None:
        feedback.reset()
    replica.deactivate()
