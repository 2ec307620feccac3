"""This process's part of one fragment's sync, as the engine gathers it from its replicas: the healthy
replicas' pseudogradients summed (fp32) or encoded one message each (compressed), their norms, and the sum
of their unit vectors, which gives the mean pairwise cosine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
