"""The torch.distributed backend: one replica group per process, gloo on CPU, nccl on CUDA.

Set-up reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every collective here
must be called by every rank in the same order; a rank that is missing makes the others wait until
`backend.torch.timeout_s`, after which torch raises and the run stops with that error.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from muloco.comm.base import CompletedHandle
from muloco.errors import UserError


class _FlatHandle:
    """Waits on an async collective over one flat buffer, then copies the result back into the tensors."""

    def __init__(self, work, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        self.work, self.flat, self.tensors = work, flat, tensors

    def wait(self) -> list[torch.Tensor]:
        self.work.wait()
        for t, synced in zip(self.tensors, _unflatten_dense_tensors(self.flat, self.tensors), strict=True):
            t.copy_(synced)
        return self.tensors


class TorchDistBackend:
    def __init__(self, timeout_s: float = 300.0, dist_backend: str = "auto") -> None:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise UserError(
                    f"backend.kind=torch needs the torchrun environment ({var} is not set); start with "
                    "`muloco launch --nproc N` or `torchrun --nproc-per-node N -m muloco train CONFIG`"
                )
        if dist_backend == "auto":
            dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group(backend=dist_backend, timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dist_backend = dist_backend
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist_backend == "nccl" else None
        )

    def _on_comm_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device is not None else t.cpu()

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> _FlatHandle | CompletedHandle:
        if not tensors:
            return CompletedHandle(tensors)
        # One flat buffer: one collective per sync rather than one per tensor.
        flat = self._on_comm_device(_flatten_dense_tensors([t.detach() for t in tensors]))
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        return _FlatHandle(work, flat, tensors)

    def all_gather_bytes(self, payload: bytes) -> CompletedHandle:
        """Payloads of varying size: gather the sizes, then the padded payloads, in rank order."""
        mine = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.zeros(0, dtype=torch.uint8)
        )
        size = self._on_comm_device(torch.tensor([mine.numel()], dtype=torch.int64))
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        longest = int(max(s.item() for s in sizes))
        padded = self._on_comm_device(torch.zeros(max(longest, 1), dtype=torch.uint8))
        padded[: mine.numel()] = mine.to(padded.device)
        gathered = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return CompletedHandle(
            [g[: int(s.item())].cpu().numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)]
        )

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> _FlatHandle | CompletedHandle:
        if not tensors:
            return CompletedHandle(tensors)
        flat = self._on_comm_device(_flatten_dense_tensors([t.detach() for t in tensors]))
        work = dist.broadcast(flat, src=src, async_op=True)
        return _FlatHandle(work, flat, tensors)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
