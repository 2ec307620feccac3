"""Sharded Muon: Muon on FSDP2 parameters, each matrix orthogonalized whole on one owner rank.

A DiLoCo worker of R ranks that wraps its model with FSDP2 (`fully_shard` over a 1-D mesh; sharding.py)
holds every weight as a DTensor of which rank i keeps the dim-0 rows [i c, min((i + 1) c, n)), c =
ceil(n / R) (torch.chunk's split; trailing ranks may hold fewer rows or none), and FSDP2 leaves each rank
the reduced gradient of its rows. Momentum is elementwise and runs on those rows; Newton-Schulz (NS) needs
the whole matrix. As in DMuon (each matrix has one owner rank, owners balanced by NS cost; the same
`balance` and `ns_flops` as DistributedMuon), a `step()` is

    1. momentum   on every rank, on its rows: B <- lerp(B, g, 1 - momentum), U = lerp(g, B, momentum)
                  (or U = B without nesterov), exactly `muon_update`'s elementwise part
    2. gather     one all_to_all_single: each rank sends every owner its rows of U, the owner concatenates
                  them in rank order into the whole U (transient: it exists only there, only now)
    3. ns         the owner computes O = NS(U / (||U||_F + eps)), same-shape matrices stacked as in `Muon`
    4. scatter    one all_to_all_single: each rank receives its rows of O (in the NS dtype)
    5. apply      on every rank, on its rows: W <- (1 - lr wd) W - adjusted_lr(lr, (out, in)) O

Every phase is elementwise on rows or the same per-matrix maths as `Muon`, so the parameters equal
single-process Muon on the same full gradients: bitwise on the CPU where this was written, in fp32 and
bf16 NS (the tests allow 1e-5 in fp32; in bf16 an owner's stack of fewer same-shape matrices than Muon's
may take another GEMM path, as in distributed_muon.py). The momentum buffer is a DTensor laid out like its
parameter: each rank allocates only its rows, and `state_dict()` holds DTensors that
torch.distributed.checkpoint can reshard. Optimizer state per rank is ~1/R of Muon's (row counts differ
by up to one chunk per matrix). Transient per step: a rank's send buffers (its rows of U and of its O's),
and on an owner the whole U, its stack and O of the matrices it owns.

Why all_to_all and not R broadcasts (DistributedMuon): each rank holds only part of every matrix, so the
owner must gather before NS and every rank needs only its rows of O after it. Each all_to_all moves each
row once, (R-1)/R of the parameters over the network (a reduce-scatter's traffic); the second in the NS
dtype, half the bytes in bf16. U travels in the gradients' dtype, so the owner's norm is Muon's.

Plain-tensor parameters (no FSDP, or a model only partly wrapped) are stepped exactly as `Muon` steps
them, on every rank, with no collective: a mesh of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from muloco.optim.distributed_muon import balance, ns_flops
from muloco.optim.muon import Muon, _buckets, adjusted_lr, oriented, stack_normalized
from muloco.optim.orthogonalize import (
    EPS,
    default_ns_dtype,
    ns_iterate,
    resolve_coefficients,
)


def shard_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows that `rank` holds of `rows` under Shard(0) (torch.chunk's split:
    ceil(rows / world_size) per rank, so trailing ranks may hold fewer rows or none)."""
    chunk = -(-rows // world_size)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def oriented_shape(shape: Sequence[int], transposed: bool) -> tuple[int, ...]:
    """The shape Muon sees, (out, in): `oriented(t, transposed).shape` without touching a DTensor."""
    return tuple(reversed(shape)) if transposed else tuple(shape)


def _sharded(p: Tensor) -> bool:
    return isinstance(p, DTensor)


class ShardedMuon(Muon):
    """Muon for FSDP2-sharded (DTensor) parameters; see the module docstring for the step.

    Takes Muon's hyperparameters (see `Muon`); no process group argument: the ranks are those of the
    parameters' device mesh (`p.device_mesh.get_group()`), which must be one 1-D mesh for all DTensor
    parameters, placed (Shard(0),) (fully_shard's default). Plain-tensor parameters are stepped as by
    `Muon` (a mesh of one).

    Contract: call `step()` on every rank of the mesh, after FSDP2's backward (the gradients are already
    reduce-scattered), with the same set of parameters holding a gradient on every rank. Owners are
    balanced over all parameter groups at once (`balance` of `ns_flops` of the (out, in) shapes); add
    every group before the first step.

    State: `momentum_buffer` per parameter, a DTensor with the parameter's mesh and placement (this rank's
    rows only) for a DTensor parameter, a full tensor for a plain one. `state_bytes()` counts this rank's.
    """

    # Muon's constructor calls add_param_group, which finds the mesh and assigns owners; until a group
    # holds DTensors these are a mesh of one.
    mesh: DeviceMesh | None = None
    process_group: dist.ProcessGroup | None = None
    world_size, rank = 1, 0
    _owner: dict[Tensor, int] = {}  # DTensor parameter -> owner rank; replaced, never mutated

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.state:
            raise ValueError(
                "ShardedMuon balances owners over all matrices at once; add every param group before the "
                "first step"
            )
        super().add_param_group(param_group)
        sharded = [(p, group) for group in self.param_groups for p in group["params"] if _sharded(p)]
        if not sharded:
            return
        for p, _ in sharded:
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"ShardedMuon needs DTensor parameters sharded by rows over a 1-D mesh, placements "
                    f"(Shard(0),), got a {tuple(p.shape)} parameter with {tuple(p.placements)} on a "
                    f"{p.device_mesh.ndim}-D mesh; wrap with fully_shard(module, mesh=<1-D mesh>) and its "
                    "default placement"
                )
        mesh = sharded[0][0].device_mesh
        if any(p.device_mesh != mesh for p, _ in sharded):
            raise ValueError("ShardedMuon needs all its DTensor parameters on one device mesh (the worker's)")
        if len({p.dtype for p, _ in sharded}) > 1:
            raise ValueError(
                "ShardedMuon needs all its DTensor parameters in one dtype (they are exchanged in one "
                f"buffer), got {sorted({str(p.dtype) for p, _ in sharded})}"
            )
        self.mesh, self.process_group = mesh, mesh.get_group()
        self.world_size, self.rank = mesh.size(), mesh.get_local_rank()
        costs = [
            ns_flops(oriented_shape(p.shape, g.get("transposed", False)), g["ns_steps"], self.ns_method)
            for p, g in sharded
        ]
        self._owner = dict(zip([p for p, _ in sharded], balance(costs, self.world_size), strict=True))

    @property
    def owners(self) -> list[int]:
        """The owner rank of each DTensor parameter, in parameter-group order."""
        return list(self._owner.values())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Bucket every parameter first (this checks every gradient on every rank, so a bad one raises on
        # all ranks before any collective). Plain parameters: Muon's step, on every rank, no collective.
        for group in self.param_groups:
            coefficients = resolve_coefficients(group["ns_coefficients"])
            for bucket in _buckets(group["params"]):
                plain = [p for p in bucket if not _sharded(p)]
                if plain:
                    self._step_bucket(plain, group, coefficients)
        stepping = [
            p for group in self.param_groups for p in group["params"] if _sharded(p) and p.grad is not None
        ]
        if not stepping:
            return loss
        updates = self.local_updates()  # 1. this rank's rows of U
        full = self.gather_owned(stepping, updates)  # 2. the whole U of this rank's matrices
        owned = self.orthogonalize_owned(full)  # 3. O of this rank's matrices
        rows = self.scatter_rows(stepping, owned)  # 4. this rank's rows of every O
        self.apply_updates(rows)  # 5. W <- (1 - lr wd) W - adjusted_lr O on this rank's rows
        return loss

    def _momentum_buffer(self, p: DTensor) -> Tensor:
        """This rank's rows of p's momentum buffer, created as zeros (a DTensor like p) at the first step."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            rows = torch.zeros_like(p.to_local(), memory_format=torch.preserve_format)
            state["momentum_buffer"] = DTensor.from_local(
                rows, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return state["momentum_buffer"].to_local()

    def local_updates(self) -> dict[Tensor, Tensor]:
        """Phase 1, on every rank: momentum on this rank's rows; DTensor parameter -> its rows of U, stored
        orientation (`muon_update`'s elementwise part: the same lerps on the same elements)."""
        updates: dict[Tensor, Tensor] = {}
        with torch.profiler.record_function("muloco::sharded_muon_momentum"):
            for group in self.param_groups:
                params = [p for p in group["params"] if _sharded(p) and p.grad is not None]
                if not params:
                    continue
                grads = []
                for p in params:
                    assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, f"{p.grad=}"
                    grads.append(p.grad.to_local())
                    # The exchanges' split sizes assume torch.chunk's rows (`shard_rows`), FSDP2's layout.
                    assert grads[-1].numel() == self._local_numel(p, self.rank), (
                        f"{p.shape=} {grads[-1].shape=}"
                    )
                buffers = [self._momentum_buffer(p) for p in params]
                momentum = group["momentum"]
                torch._foreach_lerp_(buffers, grads, 1 - momentum)
                local = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
                updates.update(zip(params, local, strict=True))
        return updates

    def _local_numel(self, p: Tensor, rank: int) -> int:
        start, stop = shard_rows(p.shape[0], self.world_size, rank)
        return (stop - start) * math.prod(p.shape[1:])

    def _all_to_all(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        """One all_to_all_single over the mesh's group; `send` itself on a mesh of one.

        Collective: every rank of the mesh calls it, the same number of times in the same order (gloo and
        NCCL match collectives by issue order); the split sizes are computed alike on every rank from the
        ownership and the set of parameters with a gradient. A rank that fails before the call leaves the
        others waiting until the process group's timeout, after which torch raises on them.
        """
        if self.world_size == 1:
            return send
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.process_group)
        return recv

    def gather_owned(self, stepping: list[Tensor], updates: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Phase 2: DTensor parameter -> the whole U (stored shape), for the matrices this rank owns.

        The send buffer is, for owner d = 0..R-1, this rank's rows of the matrices d owns in `stepping`
        order; so the part from rank s holds, in the same order, rank s's rows of this rank's matrices.
        """
        mine = [p for p in stepping if self._owner[p] == self.rank]
        with torch.profiler.record_function("muloco::sharded_muon_gather"):
            to = [[p for p in stepping if self._owner[p] == d] for d in range(self.world_size)]
            send = torch.cat([updates[p].reshape(-1) for params in to for p in params])
            send_sizes = [sum(updates[p].numel() for p in params) for params in to]
            recv_sizes = [sum(self._local_numel(p, s) for p in mine) for s in range(self.world_size)]
            recv = self._all_to_all(send, send_sizes, recv_sizes)
            pieces: dict[Tensor, list[Tensor]] = {p: [] for p in mine}
            for s, part in enumerate(recv.split(recv_sizes)):
                for p, rows in zip(mine, part.split([self._local_numel(p, s) for p in mine]), strict=True):
                    pieces[p].append(rows)
            # Rank order is row order: the concatenated flat rows are the whole matrix, row-major.
            return {p: torch.cat(pieces[p]).view(p.shape) for p in mine}

    def orthogonalize_owned(self, full: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Phase 3, on the owner: DTensor parameter -> O, (out, in) in the NS dtype. Muon's buckets restricted
        to this rank's matrices, each one `stack_normalized` + `ns_iterate` call as in `muon_update`."""
        owned: dict[Tensor, Tensor] = {}
        for group in self.param_groups:
            coefficients = resolve_coefficients(group["ns_coefficients"])
            transposed = group.get("transposed", False)
            for bucket in _buckets(group["params"]):
                mine = [p for p in bucket if p in full]
                if not mine:
                    continue
                device = full[mine[0]].device
                dtype = self.ns_dtype or default_ns_dtype(device)
                # An autocast context around step() must not change the iteration's dtype.
                with (
                    torch.autocast(device.type, enabled=False),
                    torch.profiler.record_function("muloco::sharded_muon_ns"),
                ):
                    X = stack_normalized(
                        [oriented(full[p], transposed) for p in mine], coefficients.norm_scale, EPS, dtype
                    )  # (N, out, in)
                    O = ns_iterate(X, coefficients.schedule(group["ns_steps"]), self.ns_method)
                owned.update(zip(mine, O, strict=True))
        return owned

    def scatter_rows(self, stepping: list[Tensor], owned: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Phase 4: DTensor parameter -> this rank's rows of O (flat, stored orientation, the NS dtype).

        The send buffer is, for rank d = 0..R-1, d's rows of this rank's O's in `stepping` order, each O
        back in the stored orientation (the transpose of (out, in) for a transposed group).
        """
        transposed = {p: g.get("transposed", False) for g in self.param_groups for p in g["params"]}
        mine = [p for p in stepping if self._owner[p] == self.rank]
        stored = {p: oriented(owned[p], transposed[p]).reshape(p.shape) for p in mine}
        with torch.profiler.record_function("muloco::sharded_muon_scatter"):
            chunks = []
            for d in range(self.world_size):
                for p in mine:
                    start, stop = shard_rows(p.shape[0], self.world_size, d)
                    chunks.append(stored[p][start:stop].reshape(-1))
            dtype = self.ns_dtype or default_ns_dtype(stepping[0].device)  # alike on every rank
            send = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=stepping[0].device)
            send_sizes = [sum(self._local_numel(p, d) for p in mine) for d in range(self.world_size)]
            froms = [[p for p in stepping if self._owner[p] == s] for s in range(self.world_size)]
            recv_sizes = [sum(self._local_numel(p, self.rank) for p in params) for params in froms]
            recv = self._all_to_all(send, send_sizes, recv_sizes)
            rows: dict[Tensor, Tensor] = {}
            for params, part in zip(froms, recv.split(recv_sizes), strict=True):
                sizes = [self._local_numel(p, self.rank) for p in params]
                rows.update(zip(params, part.split(sizes), strict=True))
            return rows

    def apply_updates(self, rows: dict[Tensor, Tensor]) -> None:
        """Phase 5, on every rank: W <- (1 - lr wd) W - adjusted_lr(lr, (out, in)) O on this rank's rows,
        the same elementwise arithmetic as `Muon._step_bucket`."""
        with torch.profiler.record_function("muloco::sharded_muon_apply"):
            for group in self.param_groups:
                params = [p for p in group["params"] if p in rows]
                if not params:
                    continue
                local = [p.to_local() for p in params]  # views of the parameters' rows
                lr = group["lr"]
                if group["weight_decay"] != 0:
                    torch._foreach_mul_(local, 1 - lr * group["weight_decay"])
                for p, w in zip(params, local, strict=True):
                    shape = oriented_shape(p.shape, group.get("transposed", False))  # (out, in)
                    w.add_(rows[p].view(w.shape), alpha=-adjusted_lr(lr, shape, group["adjust_lr"]))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (its rows of the sharded momentum buffers)."""
        return sum(
            (value.to_local() if isinstance(value, DTensor) else value).numel() * value.element_size()
            for state in self.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        )
