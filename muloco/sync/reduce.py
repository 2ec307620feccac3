"""The reducer protocol: how the engine averages one fragment's pseudogradients over the run's replicas.

The engine hands a reducer this process's `Contribution` (its healthy replicas' summed fp32 pseudogradients,
or their encoded messages) and gets a `PendingMean` back at once; `wait()` gives the `Mean`. Streaming
DiLoCo starts a sync, keeps training for tau inner steps and only then waits. Two implementations:

- `CollectiveReducer` (here): the local backend (simulation) and torch.distributed, with the worker
  topology (docs/topology.md). Every process calls the same collectives in the same order; the local
  backend completes at once, torch.distributed waits up to backend.torch.timeout_s.
- `SwarmReducer` (swarm.py): a hivemind swarm (matchmaking, join and catch-up, state sharing).

A reducer moves tensors and bytes and counts what it sent; it knows nothing about optimizers. The run's
state it may need (a swarm joiner loads the swarm's global parameters) comes through `SharedState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from muloco.comm import (
    Backend,
    CompletedHandle,
    Handle,
    reduce_scatter_bytes,
    ring_allgather_bytes,
    ring_allreduce_bytes,
)
from muloco.comm.topology import Topology
from muloco.compress import ErrorFeedback
from muloco.errors import UserError
from muloco.sync.codec import PseudogradientCodec, pack, pack_bound, unpack
from muloco.sync.scatter import PartitionedCodec


@dataclass
class Contribution:
    """This process's part of one fragment's sync."""

    fragment: int
    step: int  # the inner step the sync starts at (a swarm only averages peers at the same step)
    healthy: int  # local replicas that contribute (a non-finite one sends nothing)
    like: list[torch.Tensor]  # the fragment's global parameters: shapes, dtype and device of the mean
    payload_bytes: float  # one replica's message: 4 x numel uncompressed, else its encoded length
    delta_sum: list[torch.Tensor] | None = None  # uncompressed: the sum over the healthy local replicas
    messages: list[bytes] = field(default_factory=list)  # compressed: one message per healthy replica
    codec: PseudogradientCodec | PartitionedCodec | None = None  # PartitionedCodec: reduce-scatter
    owner_feedback: list[ErrorFeedback | None] = field(default_factory=list)  # per local replica (owner)
    aggregate: str = "mean"  # sync.aggregate (comm/aggregate.py): a robust rule needs the messages (codec)
    trim: int = 1  # sync.trim, for trimmed_mean
    apply_step: int | None = None  # when the mean is applied (step + tau); a torchft healer applies it then
    absent: bool = False  # no replicas by design (a torchft worker healed at the last step): not left out


@dataclass
class Mean:
    values: list[torch.Tensor] | None  # the mean pseudogradient; None when no replica contributed
    contributors: int
    left_out: int  # replicas left out as non-finite (the guard's count; a swarm: this peer's own only)
    bytes_sent: float = 0.0  # what this worker sent for the sync, known once it is done (a swarm's group)
    details: dict[str, Any] = field(default_factory=dict)  # reducer-specific log fields (e.g. group_size)
    # The reducer gave the sync up (torchft: a sync in flight whose collectives failed was not committed):
    # nothing to apply, and the replicas keep their drift for the fragment's next sync.
    dropped: bool = False
    # Contributions left out for other reasons, by kind (a swarm's: another step, a failed download, a
    # malformed payload, ...): counted in summary.json, never divergence.
    excluded: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "values": self.values,
            "contributors": self.contributors,
            "left_out": self.left_out,
            "bytes_sent": self.bytes_sent,
            "details": self.details,
            "dropped": self.dropped,
            "excluded": self.excluded,
        }


class PendingMean:
    """A started reduction; `wait()` blocks until it is done and returns the Mean (computed once, kept).
    `bytes_sent` is what this worker sends for it when that is known at the start (collectives)."""

    def __init__(self, handle: Handle, finish: Callable[[Any], Mean], bytes_sent: float = 0.0) -> None:
        self._handle, self._finish = handle, finish
        self._result: Mean | None = None
        self.bytes_sent = bytes_sent
        # Set when the reducer moved the sync: a torchft worker behind its quorum adopted a member's state
        # and joined the quorum's sync instead (its fragment, start and apply steps; nothing of its own).
        self.moved_to: Contribution | None = None

    def wait(self) -> Mean:
        if self._result is None:
            self._result = self._finish(self._handle.wait())
            self._handle = None  # drop the transfer buffers
        return self._result

    @classmethod
    def completed(cls, mean: Mean) -> PendingMean:
        return cls(CompletedHandle(mean), lambda m: m)


class SharedState(Protocol):
    """What a reducer may read and replace of the run (the engine implements it)."""

    def export_state(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        """Global parameters + outer momentum, and the step counters."""
        ...

    def adopt_state(self, tensors: list[torch.Tensor], meta: dict[str, int], replicas: list) -> None:
        """Continue from another peer's state: global parameters, momentum, counters; replicas restart."""
        ...

    def can_adopt(self) -> bool:
        """False while a sync is in flight or the run is over."""
        ...

    @property
    def fragment_syncs(self) -> int: ...


# The transports of compressed syncs (transport.py). reduce_scatter needs a fixed part owner per part for
# the whole sync, and every member of the sync's group in both of its collectives.
ALL_TRANSPORTS = ("all_gather", "reduce_scatter")


class Reducer(Protocol):
    workers: int | None  # K when fixed (collectives); None for a swarm, whose groups come and go
    # The compressed transports it can carry; sync.transport=auto picks only among these (transport.py).
    transports: tuple[str, ...]
    # Whether it carries a whole window overlapped (sync.overlap = H: a sync in flight at every start), and
    # eager updates (each worker's own outer state). A swarm's catch-up hands a state over at any time;
    # torchft's heal at a quorum, where a whole window's due sync is already applied (engine.round), and
    # under eager updates the consensus, from which the healer restarts its own (eager.py).
    whole_window: bool
    eager_updates: bool

    def local_replicas(self, workers: int) -> list[int]:
        """The global indices of the replicas this process hosts."""
        ...

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        """Set up for these fragments (a swarm starts its DHT and averagers here)."""
        ...

    def join(self, state: SharedState, replicas: list, resumed: bool) -> None:
        """Before the first round: a swarm joiner catches up with the swarm; collectives do nothing."""
        ...

    def start_mean(self, contribution: Contribution) -> PendingMean: ...

    def after_sync(self, state: SharedState, mean: Mean, replicas: list) -> None:
        """After a sync was applied: a swarm peer that fell behind realigns; collectives do nothing."""
        ...

    def conclude(self, state: SharedState, replicas: list) -> dict[str, Any]:
        """After the run's last sync, before its final checkpoint: a swarm's final agreement (a peer whose
        model differs from the majority's adopts it, or raises TrainingError); returns summary.json fields.
        Collectives agree by construction: nothing to do."""
        ...

    def close(self) -> None: ...


def check_whole_window(reducer: Reducer, sync) -> None:
    """A whole window overlapped (sync.overlap = H) or eager updates only on a reducer that carries them
    (`whole_window`, `eager_updates`; one that does not declare them, a user's own through the Python API,
    is taken to)."""
    if sync.overlap >= sync.every and not getattr(reducer, "whole_window", True):
        raise UserError(
            f"sync.overlap={sync.overlap} (a whole window) keeps a sync in flight at every sync, which this "
            f"backend's state hand-over does not carry yet; use sync.overlap < {sync.every}"
        )
    if sync.eager and not getattr(reducer, "eager_updates", True):
        raise UserError(
            "sync.eager keeps each worker's own outer parameters, which this backend's state hand-over "
            "does not carry yet; use sync.eager=false"
        )


class CollectiveReducer:
    """The mean over all K replicas with collectives: an all-reduce of fp32 sums, or an all-gather of
    compressed messages that every process decodes in replica order (so all processes, and the
    simulation, hold the same mean, bit for bit). With workers of R ranks (topology.worker), the lead rank
    of each worker takes part across workers and broadcasts the mean to its worker's other ranks; sharded
    workers have no lead: every rank averages its rows with the same rank of the other workers."""

    transports = ALL_TRANSPORTS
    whole_window = eager_updates = True

    def __init__(self, topology: Topology, workers: int) -> None:
        self.topology, self.workers = topology, workers

    @classmethod
    def over(cls, backend: Backend, workers: int | None = None) -> CollectiveReducer:
        """One replica group per process of `backend` (the Python API's case: K = world size)."""
        topology = Topology(1, backend.world_size, backend.rank, 0, backend, None)
        return cls(topology, workers or backend.world_size)

    def local_replicas(self, workers: int) -> list[int]:
        """Worker group g of G hosts replicas [g K/G, (g + 1) K/G)."""
        G, g = self.topology.num_workers, self.topology.worker_index
        if workers % G != 0:
            raise UserError(
                f"workers ({workers}) must be divisible by the number of processes / ranks_per_worker ({G}); "
                "change workers"
            )
        per_worker = workers // G
        return list(range(g * per_worker, (g + 1) * per_worker))

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        pass

    def join(self, state: SharedState, replicas: list, resumed: bool) -> None:
        pass

    def start_mean(self, contribution: Contribution) -> PendingMean:
        """Every process calls this for every sync, in the same order (a collective)."""
        c, K = contribution, self.workers
        pending = None
        if self.topology.sync is not None:  # this rank takes part across workers (R = 1: every rank)
            if c.codec is None:
                pending = _start_mean_uncompressed(self.topology.sync, c.delta_sum, c.healthy, K)
            elif isinstance(c.codec, PartitionedCodec):
                pending = _start_mean_partitioned(self.topology.sync, c, K)
            else:
                pending = _start_mean_compressed(self.topology.sync, c, K)
        if self.topology.worker is not None and not self.topology.sharded:
            pending = share_with_worker(self.topology.worker, pending, c.like)
        if c.codec is None:
            pending.bytes_sent = ring_allreduce_bytes(c.payload_bytes, K)
        elif isinstance(c.codec, PartitionedCodec):
            pending.bytes_sent = 0.0  # both stages are booked when the mean is there (Mean.bytes_sent)
        else:
            pending.bytes_sent = ring_allgather_bytes(c.payload_bytes, K)
        return pending

    def after_sync(self, state: SharedState, mean: Mean, replicas: list) -> None:
        pass

    def conclude(self, state: SharedState, replicas: list) -> dict[str, Any]:
        return {}  # every process applied the same mean

    def close(self) -> None:
        pass


def _start_mean_uncompressed(
    backend: Backend, local_sum: list[torch.Tensor], contributors: int, workers: int
) -> PendingMean:
    """fp32: one all-reduce (sum) of this process's sum over its `contributors` healthy replicas, with the
    count riding along in the same buffer, then / the total count. Overwrites local_sum."""
    count = torch.tensor([float(contributors)], dtype=local_sum[0].dtype, device=local_sum[0].device)
    handle = backend.all_reduce_sum([*local_sum, count])

    def finish(total: list[torch.Tensor]) -> Mean:
        n = int(round(total[-1].item()))
        return Mean([t.div_(n) for t in total[:-1]] if n > 0 else None, n, workers - n)

    return PendingMean(handle, finish)


def _start_mean_compressed(backend: Backend, c: Contribution, max_replicas: int) -> PendingMean:
    """Compressed (or a robust sync.aggregate): all-gather every process's messages (one per healthy
    replica); every process decodes all of them in replica order and combines them (comm/aggregate.py)."""
    per_process = max_replicas // backend.world_size  # at most this many healthy replicas each
    capacity = c.codec.packed_bound([t.shape for t in c.like], per_process)
    handle = backend.all_gather_bytes(pack(c.messages), capacity=capacity)

    def finish(blobs: list[bytes]) -> Mean:
        values, seen = c.codec.decode_mean(blobs, max_replicas, c.like, c.aggregate, c.trim)
        return Mean(values, seen, max_replicas - seen)

    return PendingMean(handle, finish)


def _start_mean_partitioned(backend: Backend, c: Contribution, workers: int) -> PendingMean:
    """Reduce-scatter (scatter.py): process m of W hosts replicas [m k, (m+1) k) (k = K / W) and owns their
    parts. Each process sends process q, for each part q owns, its healthy replicas' messages of that part
    (one all-to-all); when waited for, it averages the parts it owns and every process all-gathers the
    owners' means (a second collective, at the same wait on every process) and decodes all of them. Both
    collectives are padded to bounds every process computes alike, so neither waits for an exchange of
    sizes first (K round trips per sync over a slow link)."""
    codec, W = c.codec, backend.world_size
    k, rank = workers // W, backend.rank
    assert k * W == workers, f"{workers=} {W=}"
    owned = [range(q * k, (q + 1) * k) for q in range(W)]
    by_replica = [codec.split(message) for message in c.messages]  # [replica][part]
    outgoing = [pack([pack([parts[j] for parts in by_replica]) for j in owned[q]]) for q in range(W)]
    # Up to k healthy replicas' messages of each owned part.
    to_owner = [pack_bound([pack_bound([codec.part_bound(j)] * k) for j in owned[q]]) for q in range(W)]
    means_bound = max(pack_bound([codec.mean_bound(j) for j in owned[q]]) for q in range(W))
    handle = backend.all_to_all_bytes(outgoing, capacities=to_owner)
    message_bytes = c.payload_bytes

    def finish(received: list[bytes]) -> Mean:
        from_processes = [
            unpack(blob, views=True) for blob in received
        ]  # [process][owned part] -> packed messages
        means = []
        for i in range(k):  # the parts this process owns, in replica order of their contributions
            messages = [m for parts in from_processes for m in unpack(parts[i], views=True)]
            means.append(codec.average(rank * k + i, messages, c.owner_feedback[i], c.like))
        # Every process calls this all-gather at the same wait (syncs finish in the same order everywhere).
        gathered = backend.all_gather_bytes(pack(means), capacity=means_bound).wait()
        owners = [m for blob in gathered for m in unpack(blob, views=True)]
        values, contributors = codec.decode_means(owners, c.like)
        sent = reduce_scatter_bytes(message_bytes, sum(map(len, owners)), workers)
        return Mean(values, contributors, workers - contributors, sent)

    return PendingMean(handle, finish)


def share_with_worker(worker: Backend, pending: PendingMean | None, like: list[torch.Tensor]) -> PendingMean:
    """A worker of R ranks: its lead rank (pending is its mean across workers; None on the other ranks)
    broadcasts the mean, its counts, the bytes it sent (reduce-scatter books them at the end) and whether
    it was dropped (torchft) to the worker's ranks when waited for. Every rank of the worker calls the
    broadcasts, in the same order."""

    def finish(_) -> Mean:
        # contributors, left out, bytes sent, dropped
        meta = torch.zeros(4, dtype=torch.float64, device=like[0].device)
        details: dict[str, Any] = {}
        excluded: dict[str, int] = {}
        if pending is not None:
            mean = pending.wait()
            values = mean.values or [torch.zeros_like(t) for t in like]
            counts = [mean.contributors, mean.left_out, mean.bytes_sent, float(mean.dropped)]
            meta.copy_(torch.tensor(counts, dtype=torch.float64))
            details, excluded = mean.details, mean.excluded
        else:
            values = [torch.empty_like(t) for t in like]
        values = worker.broadcast(values, src=0).wait()
        n, left_out, sent, dropped = worker.broadcast([meta], src=0).wait()[0].tolist()
        usable = n > 0 and not dropped
        values = values if usable else None
        return Mean(values, int(n), int(left_out), sent, details, bool(dropped), excluded)

    return PendingMean(CompletedHandle(None), finish)
