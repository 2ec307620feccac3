"""The local backend: one process hosts all K replicas, so every cross-process collective is an identity."""

from __future__ import annotations

import torch

from muloco.comm.base import CompletedHandle


class LocalBackend:
    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> CompletedHandle:
        return CompletedHandle(tensors)

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None) -> CompletedHandle:
        return CompletedHandle([payload])

    def all_to_all_bytes(self, payloads: list[bytes], capacities: list[int] | None = None) -> CompletedHandle:
        assert len(payloads) == 1, f"{len(payloads)=} but the local backend has one process"
        return CompletedHandle(list(payloads))

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> CompletedHandle:
        assert src == 0, f"{src=} but the local backend has one process"
        return CompletedHandle(tensors)

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
