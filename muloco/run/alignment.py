"""How well the K workers' pseudogradients agree, and with what one big-batch replica would have done.

`diagnostics.alignment: true` (simulation only) adds a *probe*: one more replica that starts every round
from the same global parameters as the K workers and takes the same H inner steps on the union of their
batches (K x a worker's batch per step: the data-parallel, "K = 1" direction of the MuLoCo paper's
comparison). Its own inner optimizer state persists across rounds, as the workers' does. At each sync the
trainer logs, besides the workers' mean pairwise cosine (`pseudograd_cosine`):

    cos_to_union        mean_k cos(delta_k, delta_union): how far each worker's H steps point where the
                        big-batch replica went
    mean_cos_to_union   cos(mean_k delta_k, delta_union): the same for the averaged pseudogradient
    norm_retention      ||mean_k delta_k|| / mean_k ||delta_k||: 1 when the workers agree, 1/sqrt(K) when
                        they are orthogonal (what averaging cancels)
    top_sv_retention    mean over hidden matrices of sigma_1(mean delta) / mean_k sigma_1(delta_k): the
                        paper's "interference" on the leading direction
    erank_workers       mean over hidden matrices of mean_k erank(delta_k) / min(rows, cols)
    erank_mean          the same for the averaged pseudogradient (erank: exp of the entropy of the
                        normalized singular values, Roy & Vetterli 2007)

The probe costs one data-parallel step per inner step and is not checkpointed: a resumed run restarts
it from the global parameters with a fresh inner state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def flat_norm(tensors: list[Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in tensors))


def flat_cosine(a: list[Tensor], b: list[Tensor]) -> float:
    """Cosine of two parameter lists read as one vector each."""
    dot = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    return dot / max(flat_norm(a) * flat_norm(b), 1e-30)


def effective_rank(singular_values: Tensor) -> float:
    """exp(H(p)) with p = s / sum(s): 1 for a rank-one matrix, min(rows, cols) for a flat spectrum."""
    p = singular_values / singular_values.sum().clamp_min(1e-30)
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def alignment_stats(deltas: list[list[Tensor]], union: list[Tensor], matrices: list[int]) -> dict[str, float]:
    """The statistics above for the K workers' pseudogradients `deltas` (each a list over parameters),
    the probe's `union` pseudogradient, and the indices of the hidden matrices for the spectra."""
    K = len(deltas)
    mean = [sum(parts) / K for parts in zip(*deltas, strict=True)]
    top_ratios, erank_workers, erank_mean = [], [], []
    for i in matrices:
        short = min(mean[i].shape[0], mean[i].numel() // mean[i].shape[0])
        worker_svs = [torch.linalg.svdvals(d[i].reshape(d[i].shape[0], -1)) for d in deltas]
        mean_svs = torch.linalg.svdvals(mean[i].reshape(mean[i].shape[0], -1))
        top_ratios.append(float(mean_svs[0]) / max(sum(float(s[0]) for s in worker_svs) / K, 1e-30))
        erank_workers.append(sum(effective_rank(s) for s in worker_svs) / K / short)
        erank_mean.append(effective_rank(mean_svs) / short)
    return {
        "cos_to_union": sum(flat_cosine(d, union) for d in deltas) / K,
        "mean_cos_to_union": flat_cosine(mean, union),
        "norm_retention": flat_norm(mean) / max(sum(flat_norm(d) for d in deltas) / K, 1e-30),
        "top_sv_retention": _mean(top_ratios),
        "erank_workers": _mean(erank_workers),
        "erank_mean": _mean(erank_mean),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class UnionStream:
    """The K workers' streams read together: next_batch(n) is the K workers' next n sequences each."""

    def __init__(self, streams: list) -> None:
        self.streams = streams

    def next_batch(self, n_seqs: int) -> tuple[Tensor, Tensor]:
        parts = [stream.next_batch(n_seqs) for stream in self.streams]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])  # (K n, T) each

    def seek(self, position: int) -> None:
        """Continue where the workers are (a resumed run): every stream at `position` samples."""
        for stream in self.streams:
            stream.load_state_dict({"position": position})


class AlignmentProbe:
    """The big-batch replica and the workers' pseudogradients of the current sync."""

    def __init__(self, replica, matrices: list[int]) -> None:
        self.replica = replica  # a Replica whose stream is a UnionStream
        self.matrices = matrices  # parameter indices of the hidden matrices (Muon's side)
        self.deltas: list[list[Tensor]] = []

    def train_until(
        self, end: int, lr_multiplier, micro_batches: int, seqs_per_micro: int, grad_clip: float, autocast
    ) -> None:
        """The workers' inner steps up to `end`, on the union of their batches (lr_multiplier(step))."""
        replica = self.replica
        while replica.inner_steps < end:
            multiplier = lr_multiplier(replica.inner_steps)
            replica.train_step(micro_batches, seqs_per_micro, multiplier, grad_clip, autocast)
            replica.inner_steps += 1

    def restart_from(self, global_params: list[Tensor], position: int | None = None) -> None:
        """Start the next round from the global parameters (and, on resume, at the workers' stream
        position)."""
        self.replica.load_global(global_params)
        if position is not None:
            self.replica.stream.seek(position)

    def observe(self, delta: list[Tensor]) -> None:
        """One worker's pseudogradient of this sync (kept until `stats`)."""
        self.deltas.append([d.detach().clone() for d in delta])

    def stats(self, global_params: list[Tensor]) -> dict[str, float]:
        union = self.replica.pseudogradient(global_params)
        result = alignment_stats(self.deltas, union, self.matrices) if self.deltas else {}
        self.deltas = []
        return result
