"""The parameter owner's book of asynchronous outer updates (sync.mode: async; docs/heterogeneous.md): the
global parameters, the windows handed out against the run's budget of worker steps, and each arriving
pseudogradient applied at once by delayed Nesterov (delayed_nesterov.py; Liu et al. 2024, arXiv 2401.09135,
Algorithm 3). The simulation's event loop (run/async_rounds.py) and the processes' parameter owner
(sync/param_owner.py) both keep their book here, so the rule is written once.

Equal tokens: the run's budget is K x total_steps worker steps; a window is cut to what the budget has
left, and a worker handed 0 steps is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from muloco.compress import CompressionError
from muloco.sync.counters import Component, wiring
from muloco.sync.delayed_nesterov import DelayedNesterov


@dataclass
class Arrivals(Component):
    arrivals: int = 0  # pseudogradients applied (or left out as non-finite)
    claimed: int = 0  # worker steps handed to windows
    credited: int = 0  # worker steps whose pseudogradients arrived
    params: list[torch.Tensor] = wiring()  # the global parameters, updated in place
    outer: DelayedNesterov = wiring()
    codec: Any = wiring()  # None: fp32 messages
    window: Callable[[int], int] = wiring()  # worker -> its window's steps (H, or DyLU's H_w)
    workers: int = wiring(0)
    total_steps: int = wiring(0)

    @property
    def budget(self) -> int:
        return self.workers * self.total_steps

    def claim(self, worker: int) -> int:
        """The steps of `worker`'s next window, cut to what the budget has left (0: it is done)."""
        steps = max(0, min(self.window(worker), self.budget - self.claimed))
        self.claimed += steps
        return steps

    def apply(self, steps: int, message: bytes | list[torch.Tensor] | None) -> tuple[float | None, float]:
        """One window of `steps` steps arrived: its message (the codec's bytes, fp32 bytes, or the decoded
        tensors) applied to the global parameters; None: a non-finite window, left out. Returns the
        update's norm (None when left out) and the message's bytes."""
        self.arrivals += 1
        self.credited += steps
        if message is None:
            return None, 0.0
        if isinstance(message, bytes):
            payload, delta = float(len(message)), self.decode(message)
        else:
            payload, delta = 4.0 * sum(p.numel() for p in self.params), message
        delta = [d.to(p.device) for d, p in zip(delta, self.params, strict=True)]
        return self.outer.arrive(delta), payload

    def decode(self, message: bytes) -> list[torch.Tensor]:
        if self.codec is not None:
            return self.codec.decode(message, self.params)
        flat = torch.frombuffer(bytearray(message), dtype=torch.float32)
        if flat.numel() != sum(p.numel() for p in self.params):
            raise CompressionError(f"an fp32 pseudogradient of {flat.numel()} entries: another model")
        parts = flat.split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.outer.load_state_dict(state.pop("outer"))
        super().load_state_dict(state)


def fp32_message(delta: list[torch.Tensor]) -> bytes:
    """An uncompressed pseudogradient as the bytes a process sends its parameter owner."""
    return torch.cat([d.detach().float().reshape(-1).cpu() for d in delta]).numpy().tobytes()


def outer_book(cfg: Any, params: list[torch.Tensor], codec: Any, pacing: Any, total_steps: int) -> Arrivals:
    """The owner's book over the global parameters: windows of H (or, pacing by speed, DyLU's H_w),
    delayed Nesterov with N = sync.momentum_every (default K)."""
    K = cfg.workers
    return Arrivals(
        params=params,
        outer=DelayedNesterov(params, cfg.outer.lr, cfg.outer.momentum, cfg.sync.momentum_every or K),
        codec=codec,
        window=lambda w: pacing.steps_in_round(w, cfg.sync.every),
        workers=K,
        total_steps=total_steps,
    )
