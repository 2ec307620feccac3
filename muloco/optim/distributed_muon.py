"""Distributed Muon: inside one DiLoCo worker of R ranks, each hidden matrix has one owner rank.

A DiLoCo worker may span R processes that train data-parallel and all-reduce their gradients every inner
step. Plain Muon then repeats the whole Newton-Schulz (NS) work on every rank. Here (the owner-per-matrix
scheme of DMuon, with its cost-balanced owners; Keller Jordan's modded-nanogpt uses a round-robin) each
matrix is assigned to one rank, and a step is three phases:

    1. orthogonalize_owned  the owner alone updates the momentum buffer B and computes O = NS(U) for its
                            matrices (`muon_update`, same-shape matrices stacked as in `Muon`)
    2. exchange             every owner broadcasts the flat concatenation of its O's (R async broadcasts)
    3. apply_updates        every rank applies W <- (1 - lr wd) W - adjusted_lr O to every matrix

Every rank applies the same O to the same W with the same arithmetic, so the parameters stay identical
across ranks and equal single-process `Muon` on the same gradients: bitwise with fp32 NS. In bf16 an owner
that holds one matrix of a shape which Muon stacks with others can differ from Muon in the last bits: a
(1, rows, cols) stack takes another GEMM path than a larger one (seen on AVX512-BF16 CPUs, tall shapes).

Why send O and not the updated W: O is in the NS dtype (bf16 on CUDA and AVX512-BF16 CPUs), half the bytes
of fp32 weights, and applying it costs every rank one elementwise pass over the weights (O(P)) against the
NS work of O(P * min(rows, cols)) that the owners split.
Why broadcasts and not one all-gather: on gloo over loopback, with 1 thread per rank, the 18.9M updates of
the d512/L6 set (bf16) take 10 ms as 2 async broadcasts vs 38 ms as one all_gather_into_tensor of the padded
halves (measured, not explained); the broadcasts also need no padding.

Memory per rank: momentum buffers exist only on the owner, so optimizer state is ~1/R of Muon's (owners
are balanced by cost, not bytes; the d512/L6 set splits exactly at R = 2 and 4). The received updates are
transient, as Muon's NS outputs are.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Muon's own bucketing, so an owner's stacks are Muon's stacks restricted to its matrices.
from muloco.optim.muon import AdjustLR, Muon, _buckets, adjusted_lr, matrix_shape, muon_update, oriented
from muloco.optim.orthogonalize import (
    GRAM_BLOCK,
    Coefficients,
    CoefficientsLike,
    Method,
    default_ns_dtype,
    resolve_coefficients,
    uses_gram,
)


def ns_flops(shape: Sequence[int], steps: int = 5, method: Method = "auto") -> int:
    """Estimated matmul FLOPs of one Newton-Schulz call on a weight of `shape` (2 per multiply-add).

    With n = min(rows, cols), m = max(rows, cols), a "big" product (n, m) x (m, n) or (n, n) x (n, m) costs
    2 n^2 m and a "small" (n, n) x (n, n) one 2 n^3:
        standard: per step X X^T, (b A + c A^2), then (...) X  ->  steps * (2 big + 1 small)
        Gram:     per block of k <= GRAM_BLOCK steps: R = X X^T and X <- Q X (2 big), plus k Z's, k - 1
                  Q Z's and k - 1 Z R Z's (4k - 3 small)
    The elementwise work (momentum, norm, the update) is O(n m), O(1/n) of the NS work, and left out.
    """
    n, m = sorted(matrix_shape(shape))
    big, small = 2 * n * n * m, 2 * n**3
    if not uses_gram(n, m, method):
        return steps * (2 * big + small)
    blocks = [min(GRAM_BLOCK, steps - start) for start in range(0, steps, GRAM_BLOCK)]
    return sum(2 * big + (4 * k - 3) * small for k in blocks)


def balance(costs: Sequence[int], bins: int) -> list[int]:
    """LPT greedy: items in decreasing cost (ties: lower index first) onto the least-loaded bin (ties: lower
    bin first). Deterministic, so every rank computes the same answer; the largest load is at most
    4/3 of the optimum (Graham 1969)."""
    if bins < 1:
        raise ValueError(f"need at least one bin (rank), got {bins}")
    owners = [0] * len(costs)
    loads = [(0, b) for b in range(bins)]  # a heap of (load, bin): the least-loaded, lowest bin on top
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(loads)
        owners[i] = b
        heapq.heappush(loads, (load + costs[i], b))
    return owners


def assign_owners(
    shapes: Sequence[Sequence[int]], world_size: int, ns_steps: int = 5, method: Method = "auto"
) -> list[int]:
    """The owner rank of each matrix: `balance` over the estimated NS cost `ns_flops` of each shape."""
    return balance([ns_flops(shape, ns_steps, method) for shape in shapes], world_size)


def _group_size_and_rank(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("DistributedMuon got a process_group but torch.distributed is not initialized")
        return 1, 0  # one process: no collectives at all
    return dist.get_world_size(process_group), dist.get_rank(process_group)


class DistributedMuon(Muon):
    """Muon whose Newton-Schulz work and momentum are split across the ranks of `process_group`.

    Takes Muon's hyperparameters (see `Muon`) plus `process_group`: the ranks of one DiLoCo worker, or None
    for the default group (or a single process when torch.distributed is not initialized).

    Contract: call `step()` on every rank of the group, after the gradients have been averaged across it
    (the caller all-reduces them), so that every rank sees the same gradients and the same set of
    parameters with a gradient. Owners are balanced over all parameter groups at once (`assign_owners`,
    per group's ns_steps); add every group before the first step.

    State: `momentum_buffer` only for the parameters this rank owns. `state_dict()` is this rank's shard
    plus the ownership layout; `load_state_dict` takes a shard saved by the same rank of the same layout,
    or a full single-process state (Muon's, or world size 1), of which it keeps the owned buffers.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: CoefficientsLike = "keller",
        adjust_lr: AdjustLR = "spectral",
        *,
        ns_dtype: torch.dtype | None = None,
        ns_method: Method = "auto",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # Set before Muon.__init__, which calls add_param_group, which assigns owners.
        self.process_group = process_group
        self.world_size, self.rank = _group_size_and_rank(process_group)
        self.owners: list[int] = []
        self._owner: dict[Tensor, int] = {}
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            adjust_lr=adjust_lr,
            ns_dtype=ns_dtype,
            ns_method=ns_method,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.state:
            raise ValueError(
                "DistributedMuon balances owners over all matrices at once; add every param group "
                "before the first step"
            )
        super().add_param_group(param_group)
        params = [p for group in self.param_groups for p in group["params"]]
        if self.world_size > 1 and len({p.device for p in params}) > 1:
            raise ValueError(
                "DistributedMuon needs all its parameters on one device (the collectives' device)"
            )
        costs = [
            ns_flops(oriented(p, group.get("transposed", False)).shape, group["ns_steps"], self.ns_method)
            for group in self.param_groups
            for p in group["params"]
        ]
        self.owners = balance(costs, self.world_size)
        self._owner = dict(zip(params, self.owners, strict=True))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owned = self.orthogonalize_owned()
        updates = self.exchange(owned)
        self.apply_updates(updates)
        return loss

    def orthogonalize_owned(self) -> dict[Tensor, Tensor]:
        """Phase 1: momentum and NS for this rank's matrices; parameter -> O (rows, cols) in the NS dtype."""
        owned: dict[Tensor, Tensor] = {}
        for group in self.param_groups:
            coefficients = resolve_coefficients(group["ns_coefficients"])
            # Bucket every parameter (this checks every gradient on every rank, so a bad one raises on all
            # ranks before any collective), then keep this rank's part of each same-shape bucket.
            for bucket in _buckets(group["params"]):
                mine = [p for p in bucket if self._owner[p] == self.rank]
                if mine:
                    owned.update(zip(mine, self._orthogonalize(mine, group, coefficients), strict=True))
        return owned

    def _orthogonalize(
        self, params: list[Tensor], group: dict[str, Any], coefficients: Coefficients
    ) -> Tensor:
        """One NS call for same-shape owned parameters, (N, rows, cols); creates their momentum buffers."""
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        device = params[0].device
        # An autocast context around step() must not change the iteration's dtype.
        with torch.autocast(device.type, enabled=False), torch.profiler.record_function("muloco::dmuon_ns"):
            transposed = group.get("transposed", False)
            return muon_update(
                [oriented(p.grad, transposed) for p in params],
                [oriented(b, transposed) for b in buffers],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                coefficients=coefficients,
                steps=group["ns_steps"],
                dtype=self.ns_dtype or default_ns_dtype(device),
                method=self.ns_method,
            )

    def exchange(self, owned: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Phase 2: every rank receives every owner's O's; parameter -> O for all parameters with a gradient.

        Collective: every rank of the group must call this once per step, after `orthogonalize_owned`.
        The layout (who sends which parameters, in which order) is computed locally from the ownership and
        the set of parameters with a gradient, which the contract makes identical on every rank; a rank
        that fails before this call leaves the others waiting until the process group's timeout, after
        which torch raises on them.
        """
        if self.world_size == 1:
            return owned
        stepping = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not stepping:
            return owned
        device = stepping[0].device
        dtype = self.ns_dtype or default_ns_dtype(device)  # the same on every rank of one machine type
        with torch.profiler.record_function("muloco::dmuon_exchange"):
            sent: list[tuple[list[Tensor], Tensor]] = []
            works = []
            # R broadcasts, issued in owner order 0..R-1 on every rank (gloo and NCCL match collectives by
            # issue order), all async so the transfers overlap; owners with nothing to send are skipped
            # alike on every rank.
            for src in range(self.world_size):
                params = [p for p in stepping if self._owner[p] == src]
                numel = sum(p.numel() for p in params)
                if numel == 0:
                    continue
                if src == self.rank:
                    flat = torch.cat([owned[p].reshape(-1) for p in params])
                else:
                    flat = torch.empty(numel, dtype=dtype, device=device)
                work = dist.broadcast(flat, group=self.process_group, group_src=src, async_op=True)
                works.append(work)
                sent.append((params, flat))
            for work in works:
                work.wait()
        updates = dict(owned)
        for params, flat in sent:
            for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
                updates.setdefault(p, chunk)  # (rows * cols,), viewed as p at apply time
        return updates

    @torch.no_grad()
    def apply_updates(self, updates: dict[Tensor, Tensor]) -> None:
        """Phase 3, on every rank: W <- (1 - lr wd) W - adjusted_lr(lr, W.shape) O, exactly as `Muon`."""
        with torch.profiler.record_function("muloco::dmuon_apply"):
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                lr = group["lr"]
                if group["weight_decay"] != 0:
                    torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
                for p in params:
                    w = oriented(p, group.get("transposed", False))  # (out, in), a view of p
                    w.add_(updates[p].view(w.shape), alpha=-adjusted_lr(lr, w.shape, group["adjust_lr"]))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (the owned momentum buffers)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.state.values()
            for value in state.values()
            if torch.is_tensor(value)
        )

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ownership"] = {"world_size": self.world_size, "rank": self.rank, "owners": list(self.owners)}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)  # do not change the caller's dict
        layout = state_dict.pop("ownership", None)
        full = layout is None or layout["world_size"] == 1
        if not full and (layout["world_size"], layout["rank"], layout["owners"]) != (
            self.world_size,
            self.rank,
            self.owners,
        ):
            saved = f"rank {layout['rank']} of {layout['world_size']}"
            raise ValueError(
                f"this optimizer state is the shard of {saved} with other owners, and this optimizer is rank "
                f"{self.rank} of {self.world_size}: load a shard on the same rank of the same layout, or "
                "a full state saved by a single process"
            )
        super().load_state_dict(state_dict)
        if full:  # keep only what this rank owns: state per rank stays ~1/R
            for p in [p for p in self.state if self._owner[p] != self.rank]:
                del self.state[p]
