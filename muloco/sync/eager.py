"""Eager updates (`sync.eager`; Kale, Douillard and Donchev 2025, "Eager updates for overlapped
communication and computation in DiLoCo", arXiv 2502.12996, Algorithm 3).

With the sync overlapped (tau > 0), the mean of window k arrives only during window k + 1. The naive delayed
update waits for it; an eager worker m takes an outer step at once at every sync, with a proxy for the mean
still travelling: its own fresh outer gradient in place of its stale one,

    g_m = mean_{k-1} + (delta_m^k - delta_m^{k-1}) / M  =  (delta_m^k + sum_{m' != m} delta_{m'}^{k-1}) / M

so its own contribution counts at once and the others' one window late. Each worker keeps its own outer
parameters theta_m and Nesterov momentum u_m (they differ between the workers between syncs), takes its
pseudogradient against theta_m (delta_m = theta_m - local_m) and starts its next window from theta_m.

What we decided where the paper is silent:
- M is K, the run's workers (the mean's weight of one worker's message); a replica left out as non-finite
  counts with delta = 0 for that window.
- The run's global parameters (the engine's `outer`) are the consensus every worker agrees on: each mean,
  when it arrives, drives the outer step on them (the naive delayed trajectory of the same windows). They
  are what is evaluated, exported and checkpointed as the global parameters; every worker's theta_m, u_m
  and last delta_m are checkpointed beside them, so a resume is exact.
- At the run's last step (or `DiLoCo.sync()`) the final syncs are applied to the consensus and every
  replica loads it: the run ends on one model, as DiLoCo does.
- A torchft heal hands over the consensus (parameters and momentum), never a worker's own outer state: the
  healed worker restarts its theta_m and u_m from the consensus, with no delta of its own in flight.
- A worker's own delta in the proxy is its exact fp32 one (it never travels); the mean carries what the
  codec sent. Under compression the difference is corrected a window later, when the mean arrives.
"""

from __future__ import annotations

from typing import Any

import torch

from muloco.sync.outer import OuterOptimizer, nesterov_outer_step


class EagerUpdates:
    def __init__(self, outer: OuterOptimizer, local_replicas: int, workers: int) -> None:
        """outer: the consensus global parameters (their lr, momentum and Nesterov setting are the
        workers' too); workers: M, the run's K."""
        self.outer, self.workers = outer, workers
        self.params = [[p.clone() for p in outer.params] for _ in range(local_replicas)]  # theta_m
        self.momentum = [[torch.zeros_like(p) for p in outer.params] for _ in range(local_replicas)]  # u_m
        self.last_delta = [[torch.zeros_like(p) for p in outer.params] for _ in range(local_replicas)]
        self.last_mean: list[torch.Tensor | None] = [None] * len(outer.params)  # mean_{k-1}, by parameter
        self.fresh: dict[int, list[torch.Tensor]] = {}  # this sync's delta_m by local position

    def base(self, position: int) -> list[torch.Tensor]:
        """What local replica `position`'s pseudogradient is taken against, and restarts from: theta_m."""
        return self.params[position]

    def keep(self, position: int, delta: list[torch.Tensor]) -> None:
        """A healthy replica's fresh delta_m of the fragment being started (copied before encoding: error
        feedback may change it in place)."""
        self.fresh[position] = [d.clone() for d in delta]

    def arrived(self, indices: list[int], mean: list[torch.Tensor] | None) -> None:
        """A fragment's mean arrived (the engine's finish): kept as mean_{k-1} for the next eager step.
        None (no usable mean: dropped, or not finite): nothing stale to stand in for, so the workers' own
        last deltas, which no mean carried, are not taken back either."""
        for i, value in zip(indices, mean or [None] * len(indices), strict=True):
            self.last_mean[i] = None if value is None else value.clone()
            if value is None:
                for deltas in self.last_delta:
                    deltas[i].zero_()

    @torch.no_grad()
    def step(self, indices: list[int], replicas: list) -> None:
        """Every local replica's eager outer step on the fragment at `indices`, then the replica starts its
        next window from its theta_m there."""
        for position, replica in enumerate(replicas):
            fresh = self.fresh.pop(position, None)
            if fresh is None:  # left out as non-finite: delta = 0
                fresh = [torch.zeros_like(self.outer.params[i]) for i in indices]
            proxy = []
            for i, new in zip(indices, fresh, strict=True):
                stale = self.last_mean[i]
                g = (new - self.last_delta[position][i]).div_(self.workers)
                proxy.append(g if stale is None else g.add_(stale))
                self.last_delta[position][i] = new
            params = [self.params[position][i] for i in indices]
            momentum = [self.momentum[position][i] for i in indices]
            o = self.outer
            nesterov_outer_step(params, proxy, momentum, o.lr, o.momentum, o.nesterov)
            replica.merge_global(self.params[position], indices, 0.0)
        self.fresh.clear()

    @torch.no_grad()
    def settle(self) -> None:
        """Every sync applied to the consensus and every replica on it (the run's end, DiLoCo.sync()):
        every worker continues from the consensus, with nothing stale left to apply (its momentum kept;
        the final syncs' deltas were applied through the consensus, not an eager step)."""
        self._restart(momentum=False)

    @torch.no_grad()
    def restart_from_consensus(self) -> None:
        """A torchft heal (engine_state.adopt_shared_state): this worker adopted a member's consensus
        parameters and momentum and joins the quorum's sync with nothing of its own. It restarts its own
        outer state from them: theta_m and u_m the consensus', no delta of its own in any mean (last delta
        0), and no stale mean yet (the next one arrives with the sync it joined, before its next eager
        step)."""
        self._restart(momentum=True)

    def _restart(self, momentum: bool) -> None:
        """Every worker's theta_m (and with `momentum` its u_m) the consensus', nothing of its own in
        flight and no stale mean."""
        for position in range(len(self.params)):
            for mine, consensus in zip(self.params[position], self.outer.params, strict=True):
                mine.copy_(consensus)
            if momentum:
                for mine, consensus in zip(self.momentum[position], self.outer.momentum_buffers, strict=True):
                    mine.copy_(consensus)
            for delta in self.last_delta[position]:
                delta.zero_()
        self.last_mean = [None] * len(self.last_mean)
        self.fresh.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "momentum": self.momentum,
            "last_delta": self.last_delta,
            "last_mean": self.last_mean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("params", "momentum", "last_delta"):
            for mine, saved in zip(getattr(self, key), state[key], strict=True):
                for dst, src in zip(mine, saved, strict=True):
                    dst.copy_(src)
        self.last_mean = [None if m is None else m.to(self.outer.device) for m in state["last_mean"]]
