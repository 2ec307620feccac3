"""The validation loss of the run's global parameters."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from muloco.sharding import local_params, reshard


@torch.no_grad()
def evaluate_global(
    replica,
    global_params: list[torch.Tensor] | None,
    val_set: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast: Callable,
) -> float:
    """Mean val loss over val_set of replica 0's model. It holds the global parameters right after a plain
    DiLoCo merge (or is the dp model): pass global_params=None. With streaming its own parameters are
    swapped for `global_params` meanwhile and put back after."""
    model = replica.model
    replica.activate()
    own = None
    if global_params is not None:
        own = [p.detach().clone() for p in local_params(model)]
        replica.load_global(global_params)
    model.eval()
    losses = []
    with record_function("muloco::eval"):
        for x, y in val_set:
            with autocast():
                losses.append(model(x.to(device), y.to(device)).item())  # a host sync per batch
    reshard(model)
    model.train()
    if own is not None:
        for p, saved in zip(local_params(model), own, strict=True):
            p.copy_(saved)
    replica.deactivate()
    return sum(losses) / len(losses)
