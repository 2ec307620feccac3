"""The Delayed Nesterov outer update of asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135,
Algorithm 3): each worker's pseudogradient g is applied to the global parameters the moment it arrives,
scaled by 1/N and without momentum, and added to a buffer; every N-th arrival folds the buffer's mean into
the momentum and applies it:

    every arrival:  Delta <- Delta + g
    N-th arrival:   m <- beta m + Delta / N;  theta <- theta - lr ((1 - cN + c) beta m + g / N);  Delta <- 0
    the others:     theta <- theta - lr (c beta m + g / N)

c (the paper's momentum activation, in [0, 1/N]; default 0) spreads part of the momentum over the arrivals
between folds. With c = 0 and N arrivals of g_1..g_N the window's total is one Nesterov step on their mean,
theta - lr (beta^2 m + (1 + beta) mean g): what synchronous DiLoCo takes
(tests/sync/test_delayed_nesterov.py).
"""

from __future__ import annotations

import torch


class DelayedNesterov:
    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float, every: int, c: float = 0.0):
        """params: the global parameters, updated in place; every: N, arrivals between momentum updates."""
        if every < 1 or not 0.0 <= c <= 1.0 / every:
            raise ValueError(f"delayed Nesterov needs N >= 1 and c in [0, 1/N], got N={every}, c={c}")
        self.params, self.lr, self.momentum, self.every, self.c = params, lr, momentum, every, c
        self.momentum_buffers = [torch.zeros_like(p) for p in params]
        self.pending = [torch.zeros_like(p) for p in params]  # Delta: the arrivals since the last fold
        self.arrivals = 0

    def arrive(self, pseudogradient: list[torch.Tensor]) -> float:
        """Apply one worker's pseudogradient now; returns the norm of the update."""
        self.arrivals += 1
        torch._foreach_add_(self.pending, pseudogradient)
        folds = self.arrivals % self.every == 0
        if folds:
            torch._foreach_mul_(self.momentum_buffers, self.momentum)
            torch._foreach_add_(self.momentum_buffers, self.pending, alpha=1.0 / self.every)
            for buffer in self.pending:
                buffer.zero_()
        share = (1 - self.c * self.every + self.c) if folds else self.c
        sq_norm = 0.0
        for theta, g, m in zip(self.params, pseudogradient, self.momentum_buffers, strict=True):
            update = g / self.every
            if share:
                update.add_(m, alpha=share * self.momentum)
            update.mul_(self.lr)
            sq_norm += float(update.pow(2).sum())
            theta.sub_(update)
        return sq_norm**0.5

    def state_dict(self) -> dict:
        return {"momentum": self.momentum_buffers, "pending": self.pending, "arrivals": self.arrivals}

    def load_state_dict(self, state: dict) -> None:
        saved_buffers = state["momentum"] + state["pending"]
        for mine, saved in zip(self.momentum_buffers + self.pending, saved_buffers, strict=True):
            mine.copy_(saved)
        self.arrivals = state["arrivals"]
