"""A replica: model parameters + inner optimizer state + its own data stream (docs/design.md).

A process hosts k >= 1 replicas. In DiLoCo each replica trains alone for H inner steps; the trainer then
reads its pseudogradient and resets it to the new global parameters. Inner optimizer state persists across
rounds, as in DiLoCo (Douillard et al. 2023).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from muloco.sharding import local_params
from muloco.sync.outer import pseudogradient


def forward_backward(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_scale: float,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> float:
    """Accumulate gradients of loss_scale x loss over the batches; return the sum of unscaled losses. A
    sharded model (sharding.py) reduce-scatters each backward's gradients over the worker's ranks and
    accumulates its rows."""
    total = 0.0
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            loss = model(x, y)
        (loss * loss_scale).backward()
        total += loss.item()  # a CPU-GPU sync point, once per micro-batch
    return total


def set_lr_multiplier(optimizer, multiplier: float) -> None:
    """Scale every group's lr by the schedule's multiplier (groups keep their base lr in 'initial_lr')."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * multiplier


class Replica:
    def __init__(self, index: int, model: nn.Module, optimizer, stream, device: torch.device) -> None:
        self.index = index  # global replica index r in [0, K)
        self.model = model
        self.optimizer = optimizer
        self.stream = stream
        self.device = device
        self.compute_time_s = 0.0  # measured inner-step time, summed over the run
        self.inner_steps = 0  # inner steps taken (a round interrupted by a signal leaves replicas apart)
        # This round's inner steps and their (emulated: train.speed) seconds (run/pacing.py); under pacing
        # by speed a worker that took its share of the round counts as done (inner_steps at the round's end).
        self.round_steps, self.round_s = 0, 0.0
        self.healthy = True  # False after a non-finite loss, until the next sync resets the replica
        # simulation.offload (offload.py): the replica lives in host memory and moves to `device` while it
        # is active; None when it always lives on `device`.
        self.offload = None
        self.on_device = True
        # A worker of R ranks (docs/topology.md): this rank computes micro-batches shard_index, +R, ... of
        # each step and the gradients are summed over the worker's ranks before the optimizer step (by
        # this rank's all-reduce over `worker` when replicated, by FSDP when sharded).
        self.shard_index, self.shard_count = 0, 1
        self.worker = None  # the worker's Backend when R > 1 and the model is replicated

    def train_step(
        self,
        micro_batches: int,
        seqs_per_micro: int,
        lr_multiplier: float,
        grad_clip: float,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        """One inner step on this replica's next batch; returns the mean training loss (with R ranks per
        worker: this rank's share of it, the shares sum to the mean)."""
        loss = self.compute_gradients(micro_batches, seqs_per_micro, lr_multiplier, grad_clip, autocast)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def compute_gradients(
        self,
        micro_batches: int,
        seqs_per_micro: int,
        lr_multiplier: float,
        grad_clip: float,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> float:
        """An inner step up to the optimizer step (which `simulation.batched` takes for all replicas at
        once): the lr for this step, gradients of the next batch (summed over the worker's ranks), clipping.
        Returns the mean training loss, as `train_step`."""
        set_lr_multiplier(self.optimizer, lr_multiplier)
        if self.shard_count == 1:
            batches = (self.stream.next_batch(seqs_per_micro) for _ in range(micro_batches))
        else:  # every rank reads the whole step (same stream position), computes its share
            everything = [self.stream.next_batch(seqs_per_micro) for _ in range(micro_batches)]
            batches = everything[self.shard_index :: self.shard_count]
        loss_sum = forward_backward(self.model, batches, 1.0 / micro_batches, self.device, autocast)
        if self.worker is not None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
            self.worker.all_reduce_sum(grads).wait()
            for p, g in zip(self.model.parameters(), grads, strict=True):
                p.grad = g
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        return loss_sum / micro_batches

    def pseudogradient(
        self, global_params: list[torch.Tensor], indices: list[int] | None = None
    ) -> list[torch.Tensor]:
        """delta = theta_global - theta_replica, in fp32 on the global parameters' device; for the
        parameters at `indices` only (a fragment) when given."""
        local = local_params(self.model)
        if indices is None:
            return pseudogradient(global_params, local)
        return pseudogradient([global_params[i] for i in indices], [local[i] for i in indices])

    @torch.no_grad()
    def load_global(self, global_params: list[torch.Tensor]) -> None:
        """Reset the replica's parameters to the global ones (the DiLoCo merge with alpha = 0)."""
        for p, g in zip(local_params(self.model), global_params, strict=True):
            p.copy_(g)

    @torch.no_grad()
    def merge_global(self, global_params: list[torch.Tensor], indices: list[int], alpha: float) -> None:
        """Streaming merge of the parameters at `indices`: local <- alpha local + (1 - alpha) global."""
        local = local_params(self.model)
        for i in indices:
            if alpha == 0.0:
                local[i].copy_(global_params[i])
            else:
                local[i].lerp_(global_params[i].to(local[i].device, local[i].dtype), 1.0 - alpha)

    @torch.no_grad()
    def reset_to(self, global_params: list[torch.Tensor]) -> None:
        """After a non-finite loss or pseudogradient: the global parameters and a fresh inner optimizer
        state (its momenta may hold the NaN)."""
        self.load_global(global_params)
        for optimizer in getattr(self.optimizer, "optimizers", [self.optimizer]):
            optimizer.state.clear()
        self.healthy = True

    def prefetch(self) -> None:
        """simulation.offload: start bringing this replica to the device while another one computes."""
        if self.offload is not None:
            self.offload.prefetch(self)

    def activate(self) -> None:
        if self.offload is not None:
            self.offload.activate(self)

    def deactivate(self) -> None:
        if self.offload is not None:
            self.offload.deactivate(self)

    def map_tensors(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace the parameters' data and the optimizer's state tensors by `move(tensor)` (offload.py
        moves a replica between host and device this way; step counters, 0-dim, stay where they are)."""
        for p in self.model.parameters():
            p.data = move(p.data)
        for state in _optimizer_states(self.optimizer):
            for key, value in state.items():
                state[key] = _moved(value, move)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "stream": self.stream.state_dict(),
            "inner_steps": self.inner_steps,
            "healthy": self.healthy,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.inner_steps, self.healthy = state["inner_steps"], state["healthy"]


def _moved(value, move: Callable[[torch.Tensor], torch.Tensor]):
    """`value` with its tensors moved, into lists and tuples too (SOAP keeps its eigenbases in a list);
    0-dim tensors (step counters) and everything else as they are."""
    if torch.is_tensor(value):
        return move(value) if value.dim() > 0 else value
    if isinstance(value, list | tuple):
        return type(value)(_moved(item, move) for item in value)
    return value


def _optimizer_states(optimizer) -> list[dict]:
    inner = getattr(optimizer, "optimizers", None)
    optimizers = inner if inner is not None else [optimizer]
    # Per-parameter dicts only (a class may keep a bare tensor there, as MADGRAD does its step count).
    return [state for opt in optimizers for state in opt.state.values() if isinstance(state, dict)]
