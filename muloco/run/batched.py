"""simulation.batched: the replicas of one process take each inner step together, with one optimizer step.

Run one after another, K replicas pay K x the per-step overhead of a small model: K optimizer steps, each a
Newton-Schulz call per matrix shape and a Python loop over the tensors. Batched, every replica first
computes its own gradients (its own batch, its own model), then one optimizer step updates all of them:
the replicas' optimizers are merged position by position into one optimizer of the same class whose groups
hold every replica's parameters and whose state *is* the replicas' own per-parameter state. Muon stacks the
K replicas' same-shape matrices into one Newton-Schulz call per shape; AdamW and SGD keep torch's own choice
of kernel (foreach on CUDA, where it then runs once over K x the tensors; the per-tensor loop on a CPU, where
the foreach kernels measured 0.79x as fast: docs/records/benchmarks.md).

The maths per parameter is unchanged (each matrix is normalized and orthogonalized on its own, moments are
elementwise), so the result equals the sequential simulation, and each replica's optimizer still owns its
state: checkpoints are interchangeable between the two modes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from muloco.optim.muon import Muon

# simulation.batched=auto turns batching on for these device types: the CPU, where the merged step measured
# faster (docs/records/benchmarks.md, "Batched replicas"); CUDA by design (one launch per shape instead
# of K), to be measured by experiments/gpu/check.sh.
BATCHED_BY_DEFAULT = ("cpu", "cuda")

# Optimizers whose step reads only `param_groups` and `self.state[p]`, per parameter: merging them is exact.
# Muon subclasses that coordinate ranks (distributed Muon) are excluded by the exact type check below.
MERGEABLE = (Muon, torch.optim.AdamW, torch.optim.SGD)


def use_batched(
    setting: bool | str, device: torch.device, local_replicas: int, ranks_per_worker: int, offloaded: bool
) -> bool:
    """Whether this process steps its replicas together (`simulation.batched`: true, false or auto);
    offloaded: replicas move to the device one at a time (simulation.offload in effect)."""
    if setting is False or local_replicas < 2 or offloaded or ranks_per_worker > 1:
        return False
    return setting is True or device.type in BATCHED_BY_DEFAULT


class _ReplicaStates(dict):
    """`optimizer.state` of a merged optimizer: every lookup is answered by the replica optimizer that owns
    the parameter, so state created, cleared (a reset replica) or loaded (a resume) there is what the merged
    step sees and updates. Nothing is ever stored here."""

    def __init__(self, owners: dict[Tensor, torch.optim.Optimizer]) -> None:
        super().__init__()
        self.owners = owners

    def __missing__(self, param: Tensor) -> dict:
        return self.owners[param].state[param]


def _settings(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}


def merge_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
    """One optimizer stepping every parameter of `optimizers` (same class, same groups, same settings, as
    replicas in lockstep have); None when they cannot be merged exactly (different classes or lrs)."""
    first = optimizers[0]
    if type(first) not in MERGEABLE or any(type(o) is not type(first) for o in optimizers):
        return None
    if any(len(o.param_groups) != len(first.param_groups) for o in optimizers):
        return None
    groups = []
    for index, group in enumerate(first.param_groups):
        settings = _settings(group)
        if any(_settings(o.param_groups[index]) != settings for o in optimizers[1:]):
            return None
        params = [p for o in optimizers for p in o.param_groups[index]["params"]]
        groups.append({**settings, "params": params})
    merged = object.__new__(type(first))
    merged.__dict__.update(first.__dict__)  # hooks, defaults and Muon's ns_dtype / ns_method
    merged.param_groups = groups
    owners = {p: o for o in optimizers for group in o.param_groups for p in group["params"]}
    merged.state = _ReplicaStates(owners)
    return merged


@torch.no_grad()
def step_together(optimizers: Sequence) -> None:
    """`step()` and `zero_grad()` of the replicas' inner optimizers (muloco InnerOptimizers or plain torch
    optimizers), merged where that is exact and one by one where it is not."""
    parts = [getattr(o, "optimizers", [o]) for o in optimizers]
    for position in zip(*parts, strict=True):
        merged = merge_optimizers(position) if len(position) > 1 else None
        if merged is not None:
            merged.step()
        else:
            for optimizer in position:
                optimizer.step()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
