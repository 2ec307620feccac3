"""The global parameters and the outer optimizer (DiLoCo, Douillard et al. 2023, Algorithm 1).

The global parameters theta live in an fp32 master copy (optionally on the CPU). Every H inner steps the
replicas' pseudogradients delta_k = theta - theta_k are averaged and drive one step of SGD with Nesterov
momentum, exactly as torch.optim.SGD(nesterov=True, dampening=0) would apply it.
"""

from __future__ import annotations

import torch


def pseudogradient(global_params: list[torch.Tensor], local_params: list[torch.Tensor]) -> list[torch.Tensor]:
    """delta = theta_global - theta_local, in fp32 on the global parameters' device."""
    return [
        g - p.detach().to(device=g.device, dtype=torch.float32)
        for g, p in zip(global_params, local_params, strict=True)
    ]


def nesterov_outer_step(
    params: list[torch.Tensor],
    pseudogradients: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    lr: float,
    momentum: float,
    nesterov: bool = True,
) -> float:
    """In place: b <- m b + delta; u = delta + m b (Nesterov) or b; theta <- theta - lr u.

    Returns the norm of the applied update lr * u.
    """
    sq_norm = 0.0
    for theta, delta, buf in zip(params, pseudogradients, momentum_buffers, strict=True):
        buf.mul_(momentum).add_(delta)
        update = delta.add(buf, alpha=momentum) if nesterov else buf.clone()
        update.mul_(lr)
        sq_norm += float(update.pow(2).sum())
        theta.sub_(update)
    return sq_norm**0.5


class OuterOptimizer:
    """fp32 master copy of the global parameters plus the outer Nesterov momentum."""

    def __init__(
        self,
        named_params: list[tuple[str, torch.Tensor]],
        lr: float,
        momentum: float,
        nesterov: bool,
        device: torch.device | str,
    ) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [p.detach().to(device=device, dtype=torch.float32, copy=True) for _, p in named_params]
        self.momentum_buffers = [torch.zeros_like(p) for p in self.params]
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.device = torch.device(device)

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def step(self, avg_pseudogradients: list[torch.Tensor], indices: list[int] | None = None) -> float:
        """One outer step on all parameters, or on those at `indices` (a Streaming DiLoCo fragment: the
        update is elementwise, so a fragment's momentum buffers are its own outer optimizer state)."""
        if indices is None:
            params, buffers = self.params, self.momentum_buffers
        else:
            params = [self.params[i] for i in indices]
            buffers = [self.momentum_buffers[i] for i in indices]
        return nesterov_outer_step(
            params, avg_pseudogradients, buffers, self.lr, self.momentum, self.nesterov
        )

    def state_dict(self) -> dict:
        return {"names": self.names, "params": self.params, "momentum_buffers": self.momentum_buffers}

    def load_state_dict(self, state: dict) -> None:
        assert state["names"] == self.names, "checkpoint's parameter names differ from the model's"
        for dst, src in zip(self.params, state["params"], strict=True):
            dst.copy_(src)
        for dst, src in zip(self.momentum_buffers, state["momentum_buffers"], strict=True):
            dst.copy_(src)
