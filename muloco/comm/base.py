"""The Backend protocol: the narrow surface the engine uses to talk to other processes.

Every collective must be called by every process of the run in the same order; a process that skips one
leaves the others waiting until the backend's timeout. Operations return a `Handle` so that a backend can
overlap them with compute (Streaming DiLoCo); `wait()` blocks until the result is there.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import torch


class Handle(Protocol):
    def wait(self) -> Any:
        """Block until the operation is complete and return its result."""
        ...

    def done(self) -> bool:
        """Whether `wait` would return at once (never blocks)."""
        ...


class CompletedHandle:
    """A handle whose result is already there (the local backend completes everything at once)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result

    def done(self) -> bool:
        return True


class Backend(Protocol):
    rank: int  # this process's index
    world_size: int  # number of processes P (the run has K = P x k replicas)

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> Handle:
        """Sum each tensor elementwise over all processes, in place; the handle returns the tensors."""
        ...

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None) -> Handle:
        """Every process contributes a payload; the handle returns the list of all, in rank order.
        capacity: a bound on every process's payload, the same on all (one collective instead of two)."""
        ...

    def all_to_all_bytes(self, payloads: list[bytes], capacities: list[int] | None = None) -> Handle:
        """Process i sends payloads[j] to process j (one per process, its own included); the handle
        returns what every process sent to this one, in rank order. capacities: capacities[j] bounds what
        any process sends to process j, the same list on all (one collective instead of two)."""
        ...

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> Handle:
        """Overwrite the tensors in place with process `src`'s values."""
        ...

    def barrier(self) -> None:
        """Wait until every process reaches this point."""
        ...

    def close(self) -> None: ...


def ring_allreduce_bytes(payload_bytes: int, workers: int) -> float:
    """Bytes one node sends in a ring all-reduce of `payload_bytes`: 2 (K-1)/K x payload (reduce-scatter
    then all-gather; Patarasuk & Yuan 2009). Zero for K = 1: nothing leaves the node."""
    return 2.0 * (workers - 1) / workers * payload_bytes


def ring_allgather_bytes(payload_bytes: float, workers: int) -> float:
    """Bytes one node sends in a ring all-gather of one `payload_bytes` message per node: (K-1) x payload
    (it forwards every other node's message once). Unlike the all-reduce this grows with K, which is why
    compressed payloads only pay off while (K-1) x compressed < 2 (K-1)/K x fp32."""
    return (workers - 1) * payload_bytes


def reduce_scatter_bytes(message_bytes: float, mean_bytes: float, workers: int) -> float:
    """Bytes one node sends in the reduce-scatter transport (sync/scatter.py): K-1 of the K parts of its
    message to their owners, then its share of the ring all-gather of the K owners' means:
    (K-1)/K x (message + mean). Constant in K, like the ring all-reduce."""
    return (workers - 1) / workers * (message_bytes + mean_bytes)


_LENGTH = struct.Struct("<Q")  # a framed payload's length, leading its buffer


def frame(payload: bytes, capacity: int) -> bytes:
    """`payload` led by its length and padded to `capacity` (+ 8 bytes): every rank's buffer the same size,
    so a bounded all-gather needs no size exchange first."""
    if len(payload) > capacity:
        raise RuntimeError(
            f"all_gather_bytes: a payload of {len(payload)} bytes exceeds its bound {capacity}"
        )
    return _LENGTH.pack(len(payload)) + payload + bytes(capacity - len(payload))


def unframe(buffer: bytes) -> bytes:
    """The payload `frame` put in `buffer`."""
    (n,) = _LENGTH.unpack_from(buffer)
    return buffer[_LENGTH.size : _LENGTH.size + n]


class ProcessMeans:
    """Means of per-replica metrics over all K replicas, from each process's (sum, count) pairs: one
    collective with several processes (every rank starts it at the same point of the round). Calling it
    waits for the collective; `ready` says whether that would block, so a log line need not cost the round
    a round trip (over a 20 ms link a 4-rank all-reduce takes ~85 ms, more than a pico inner step)."""

    def __init__(self, backend: Backend, *sums_and_counts: tuple[float, int]) -> None:
        values = torch.tensor([v for pair in sums_and_counts for v in pair], dtype=torch.float64)
        self._handle = (
            backend.all_reduce_sum([values]) if backend.world_size > 1 else CompletedHandle([values])
        )

    def ready(self) -> bool:
        return self._handle.done()

    def __call__(self) -> list[float]:
        total = self._handle.wait()[0]
        return [(total[i] / total[i + 1]).item() for i in range(0, len(total), 2)]


def means_over_processes(backend: Backend, *sums_and_counts: tuple[float, int]) -> ProcessMeans:
    """The means of `sums_and_counts` over the processes, started now (ProcessMeans)."""
    return ProcessMeans(backend, *sums_and_counts)
