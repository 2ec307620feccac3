"""Sharded workers (`sharding: fsdp`): FSDP2 inside a DiLoCo worker of R ranks (docs/topology.md).

Each worker's model is wrapped with PyTorch's `fully_shard` per block and at the root over a 1-D device mesh
of the worker's ranks, so parameters, gradients and the inner optimizer state are DTensors of which each
rank holds dim-0 rows (torch.chunk's split: ceil(n / R) rows per rank, fewer on the last ones). Everything
DiLoCo keeps outside the model works on those local rows: the fp32 global copy, the outer momentum, the
error-feedback buffers, the pseudogradients and their sync (rank j of every worker averages its rows;
sync/reduce.py). Muon orthogonalizes whole matrices on one owner rank each (optim/sharded_muon.py).

Below every package that shares these helpers (the run, the engine, the optimizers, checkpoints): it imports
nothing of muloco, only torch (docs/design.md, "Layers").

The MuLoCo paper trains its 3.1B-15B models with FSDP inside each worker (its code builds on torchtitan);
the per-block wrapping, bf16 parameters with fp32 gradient reduction and a reduce-scatter at every
micro-batch's backward (so a rank never holds whole gradients: FSDP's no_sync would keep them, upcast to
fp32, until the step's last micro-batch) are torchtitan's defaults too.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# FSDP2 and DTensor are imported where a sharded worker is built, not at start: they cost ~0.7 s of CPU per
# process (the test suite starts hundreds). Until they are imported, no tensor can be a DTensor and no
# module an FSDPModule, which is what `is_dtensor` and `reshard` rely on.


def is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def worker_mesh(worker: Any, device: torch.device) -> DeviceMesh:
    """The 1-D device mesh of this worker's ranks: `worker` is its backend (muloco.comm's TorchDistBackend),
    whose `group` is the ranks' torch.distributed process group."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(worker.group, device.type)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP wraps one by one: the children of the model's outermost `nn.ModuleList`s
    (a GPT's transformer blocks, a Hugging Face model's layers; a ModuleList inside a block, e.g. a
    mixture's experts, stays in its block's unit). A model without one is wrapped at the root only."""
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules within a block already found
    for module in model.modules():  # pre-order: an outer ModuleList comes before the ones it holds
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            for block in module:
                found.append(block)
                inside.update(id(m) for m in block.modules())
    return found


def shard_model(model: nn.Module, mesh: DeviceMesh, bf16: bool) -> nn.Module:
    """Wrap `model` in place with `fully_shard` per block and at the root. bf16 (CUDA): parameters are
    gathered and computed in bf16, gradients reduced in fp32 (FSDP2's MixedPrecisionPolicy). Gradients
    are summed over the worker's ranks, not averaged: each rank's loss is already its share of the step's
    mean (replica.py), as with `replicate`."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no PREMUL_SUM)
    return model


def reshard(model: nn.Module) -> None:
    """Back to this rank's rows after a forward without backward (an eval): FSDP2 keeps the root's
    gathered parameters until the backward that never comes. A no-op for a model that is not sharded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return  # never imported: no module is sharded
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor (a DTensor), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_params(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters as this rank holds them (plain tensors; views of the DTensors' rows)."""
    return [local(p) for p in model.parameters()]


def as_shard_of(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`rows` (this rank's part) as a DTensor laid out like the sharded parameter `like`; `rows` itself
    when `like` is not sharded. Used to checkpoint the state DiLoCo keeps per shard."""
    if not is_dtensor(like):
        return rows
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(rows, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def layout_free_fingerprint(cfg) -> str:
    """The config's fingerprint without the worker's layout: a sharded checkpoint resumes with another
    ranks_per_worker (DCP reshards it)."""
    return cfg.fingerprint(with_layout=False)
