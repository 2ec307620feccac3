"""simulation.offload: inactive replicas live in host memory; the next one is copied in while one computes.

A simulation of K replicas on one GPU holds one replica's parameters and optimizer state on the device at
a time (two while the next one arrives). Host copies are pinned, so the copies are DMA transfers that
run beside the kernels: the next replica is prefetched on a side stream while the current one trains, and a
replica that finishes its segment is copied out on the compute stream, behind its last kernels.

Stream discipline (the CUDA caching allocator ties each block to the stream that allocated it):
- device tensors are allocated on the compute stream and only *filled* by the side stream, after the
  side stream has waited for the compute stream, so a block freed by the previous replica is never
  overwritten early;
- the compute stream waits for the prefetch's event before the replica's first kernel;
- `settle()` waits for the copies out before host code (checkpoints) reads the host tensors.

On a CPU there is nothing to overlap: the same calls copy synchronously (what the tests exercise here).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def offload_applies(cfg, device: torch.device) -> bool:
    """simulation.offload moves replicas only on CUDA: on a CPU they already live in host memory."""
    return cfg.simulation.offload and device.type == "cuda"


class ReplicaOffload:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.arriving: dict[int, object] = {}  # id(replica) -> the event its prefetch records

    def prefetch(self, replica) -> None:
        """Start copying `replica` to the device (returns at once on CUDA)."""
        if id(replica) in self.arriving or replica.on_device:
            return
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.side.wait_stream(compute)  # the blocks we allocate may have been the last replica's

        def to_device(host: Tensor) -> Tensor:
            target = torch.empty_like(host, device=self.device)  # allocated on the compute stream
            with torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext():
                target.copy_(host, non_blocking=self.cuda)
            return target

        replica.map_tensors(to_device)
        replica.on_device = True
        self.arriving[id(replica)] = self.side.record_event() if self.cuda else None

    def activate(self, replica) -> None:
        """Make `replica` usable on the compute stream (prefetching it now if nobody did)."""
        self.prefetch(replica)
        event = self.arriving.pop(id(replica), None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def deactivate(self, replica) -> None:
        """Copy `replica` out to pinned host memory behind its last kernels; its device blocks are freed."""
        if not replica.on_device:
            return

        def to_host(tensor: Tensor) -> Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.cuda)
            host.copy_(tensor, non_blocking=self.cuda)
            return host

        replica.map_tensors(to_host)
        replica.on_device = False

    def settle(self) -> None:
        """Wait for the copies in flight, before host code reads the replicas."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
