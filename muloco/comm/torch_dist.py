"""The torch.distributed backend: one replica group per process, gloo on CPU, nccl on CUDA.

Set-up reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Every collective here
must be called by every rank in the same order; a rank that is missing makes the others wait until
`backend.torch.timeout_s`, after which torch raises and the run stops with that error.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from muloco.comm.base import CompletedHandle, frame, unframe
from muloco.errors import UserError

log = logging.getLogger("muloco")


def exposed_address(host: str) -> str | None:
    """The address of `host` when it is a global one, reachable from the internet; None for loopback,
    private (RFC 1918, 198.18.0.0/15, unique-local IPv6), link-local and shared (100.64.0.0/10, e.g. a
    tailnet) addresses, or when it does not resolve (init_process_group then reports it)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if address.is_global:
            return str(address)
    return None


def warn_if_exposed(host: str) -> None:
    """torch.distributed's rendezvous and gloo / nccl traffic carry no authentication or encryption
    (docs/security.md): say so once when MASTER_ADDR is on a public address."""
    address = exposed_address(host)
    if address is not None:
        log.warning(
            "torch.distributed: MASTER_ADDR=%s (%s) is a public address, and the rendezvous and the "
            "gloo/nccl traffic are neither authenticated nor encrypted: anyone who reaches the port can "
            "join or read the run; use a private network or a tunnel (docs/security.md)",
            host,
            address,
        )


class _FlatHandle:
    """Waits on an async collective over one flat buffer, then copies the result back into the tensors."""

    def __init__(self, work, flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        self.work, self.flat, self.tensors = work, flat, tensors

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> list[torch.Tensor]:
        self.work.wait()
        for t, synced in zip(self.tensors, _unflatten_dense_tensors(self.flat, self.tensors), strict=True):
            t.copy_(synced)
        return self.tensors


class _BytesHandle:
    """Waits on an async all-gather of padded byte buffers, then trims each to its true length (lengths:
    gathered before; None: each buffer is `frame`d)."""

    def __init__(self, work, gathered: list[torch.Tensor], lengths: list[int] | None) -> None:
        self.work, self.gathered, self.lengths = work, gathered, lengths

    def done(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> list[bytes]:
        self.work.wait()
        if self.lengths is not None:
            return [g[:n].cpu().numpy().tobytes() for g, n in zip(self.gathered, self.lengths, strict=True)]
        return [unframe(g.cpu().numpy().tobytes()) for g in self.gathered]


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
        if os.environ["RANK"] == "0":
            warn_if_exposed(os.environ["MASTER_ADDR"])
        self.owns_group = not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group(backend=dist_backend, timeout=timedelta(seconds=timeout_s))
        self.group = None  # None: the default (world) group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dist_backend = dist_backend
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist_backend == "nccl" else None
        )

    def subgroup(self, ranks: list[int]) -> TorchDistBackend | None:
        """A backend over the processes `ranks` of the world (every process must call this, with the same
        ranks, in the same order: torch.distributed's new_group is a collective). None on the others."""
        group = dist.new_group(ranks)
        if self.rank not in ranks:
            return None
        sub = object.__new__(TorchDistBackend)
        sub.owns_group, sub.group = False, group
        sub.rank, sub.world_size = ranks.index(self.rank), len(ranks)
        sub.dist_backend, sub.device = self.dist_backend, self.device
        return sub

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _on_comm_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device is not None else t.cpu()

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> _FlatHandle | CompletedHandle:
        if not tensors:
            return CompletedHandle(tensors)
        # One flat buffer: one collective per sync rather than one per tensor.
        flat = self._on_comm_device(_flatten_dense_tensors([t.detach() for t in tensors]))
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _FlatHandle(work, flat, tensors)

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None) -> _BytesHandle:
        """Payloads of varying size, returned in rank order by the handle. With `capacity` (a bound on
        every rank's payload, the same on all): one asynchronous all-gather of buffers of that size, each
        led by its payload's length. Without: the sizes first (small, blocking: a round trip of its own),
        then the padded payloads asynchronously."""
        mine = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.zeros(0, dtype=torch.uint8)
        )
        if capacity is not None:
            framed = torch.frombuffer(bytearray(frame(payload, capacity)), dtype=torch.uint8)
            framed = self._on_comm_device(framed)
            gathered = [torch.zeros_like(framed) for _ in range(self.world_size)]
            work = dist.all_gather(gathered, framed, group=self.group, async_op=True)
            return _BytesHandle(work, gathered, None)
        size = self._on_comm_device(torch.tensor([mine.numel()], dtype=torch.int64))
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        lengths = [int(s.item()) for s in sizes]
        padded = self._on_comm_device(torch.zeros(max(max(lengths), 1), dtype=torch.uint8))
        padded[: mine.numel()] = mine.to(padded.device)
        gathered = [torch.zeros_like(padded) for _ in range(self.world_size)]
        work = dist.all_gather(gathered, padded, group=self.group, async_op=True)
        return _BytesHandle(work, gathered, lengths)

    def all_to_all_bytes(self, payloads: list[bytes], capacities: list[int] | None = None) -> _BytesHandle:
        """Payloads of varying size, one per rank, in one all_to_all_single of the concatenated bytes (gloo
        and nccl both support it). With `capacities` (capacities[j] bounds what any rank sends rank j):
        each payload framed to its bound, so every rank knows its splits. Without: the sizes first (small,
        blocking: a round trip of its own over a slow link)."""
        assert len(payloads) == self.world_size, f"{len(payloads)=} {self.world_size=}"
        if capacities is not None:
            framed = [frame(p, cap) for p, cap in zip(payloads, capacities, strict=True)]
            send = self._on_comm_device(torch.frombuffer(bytearray(b"".join(framed)), dtype=torch.uint8))
            mine = len(framed[self.rank])
            received = self._on_comm_device(torch.zeros(mine * self.world_size, dtype=torch.uint8))
            splits = [len(f) for f in framed]
            work = dist.all_to_all_single(
                received, send, [mine] * self.world_size, splits, group=self.group, async_op=True
            )
            return _BytesHandle(work, list(received.split(mine)), None)
        sizes_out = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        sizes_in = self._on_comm_device(torch.zeros_like(sizes_out))
        dist.all_to_all_single(sizes_in, self._on_comm_device(sizes_out), group=self.group)
        lengths = [int(n) for n in sizes_in.tolist()]
        joined = b"".join(payloads)
        send = self._on_comm_device(
            torch.frombuffer(bytearray(joined), dtype=torch.uint8)
            if joined
            else torch.zeros(0, dtype=torch.uint8)
        )
        received = self._on_comm_device(torch.zeros(sum(lengths), dtype=torch.uint8))
        work = dist.all_to_all_single(
            received, send, lengths, sizes_out.tolist(), group=self.group, async_op=True
        )
        return _BytesHandle(work, list(received.split(lengths)), lengths)

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> _FlatHandle | CompletedHandle:
        if not tensors:
            return CompletedHandle(tensors)
        flat = self._on_comm_device(_flatten_dense_tensors([t.detach() for t in tensors]))
        work = dist.broadcast(flat, src=self.global_rank(src), group=self.group, async_op=True)
        return _FlatHandle(work, flat, tensors)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
