"""`ElasticReducer`: the sync engine's reducer over a torchft quorum (backend.kind=torchft; docs/backends.md).

A worker hosts one replica (its data shard is `replica_id`). At every sync (not every inner step) it asks
torchft's lighthouse for a quorum of the workers present, then averages with them through our own engine:
an fp32 all-reduce of the pseudogradient sum with the contributor count riding along, or an all-gather of
the compressed messages that every member decodes in quorum order. The mean is over the replicas that
contributed, so a smaller quorum after a death averages over those present.

A dead worker stops heartbeating and the next quorum forms without it (the lighthouse's heartbeat
timeout). One that dies mid-sync fails the sync's collectives on the members that were still exchanging
with it; each of those votes not to commit (a vote within its own replica group) and retries the sync, with
the same contribution, in a new quorum (backend.torchft.quorum_retries). A member that committed meanwhile
has moved on, so a retrying one joins the others' next sync behind their step. A worker behind the
quorum's step (restarted, or one whose sync failed while the others' committed) adopts a healthy
member's global parameters, outer momentum and step counters live during the quorum (torchft's checkpoint
transport), contributes nothing to that sync and applies its mean like the others: from there it holds
the same global state, bit for bit. Its inner optimizer state is its own: fresh in a new process, or its
own last checkpoint's when it resumed one (a peer's inner state belongs to another data shard).

Streaming fragments: a quorum per fragment's sync. The healer joins the quorum's sync, whatever fragment
it had planned (the donor serves the fragment and the apply step with its state). A sync in flight (tau > 0)
exchanges on the reducer's thread while the inner steps go on and votes when its mean is due; if it failed
it is dropped rather than retried, since the others may have moved on by then.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from muloco.comm import ring_allgather_bytes, ring_allreduce_bytes
from muloco.comm.digest import state_digest
from muloco.comm.topology import Topology
from muloco.comm.torchft_group import QuorumFailed, TorchftGroup
from muloco.config import TorchftBackendConfig
from muloco.errors import TrainingError, UserError
from muloco.sync.codec import PseudogradientCodec, pack
from muloco.sync.counters import Component
from muloco.sync.reduce import Contribution, Mean, PendingMean, SharedState, share_with_worker

log = logging.getLogger("muloco")


def replica_index(section: TorchftBackendConfig, workers: int, ranks_per_worker: int = 1) -> int:
    """This worker's replica index: backend.torchft.replica_id, else (one rank per worker) the launcher's
    RANK, else 0."""
    if section.replica_id is None and ranks_per_worker > 1:
        raise UserError(
            "backend.torchft.replica_id is needed with ranks_per_worker > 1 (RANK is the rank inside the "
            "worker); give each worker its own index, or start it with `muloco launch --backend torchft`"
        )
    index = section.replica_id if section.replica_id is not None else int(os.environ.get("RANK", "0"))
    if not 0 <= index < workers:
        raise UserError(
            f"backend.torchft.replica_id ({index}) must be below workers ({workers}): it picks this worker's "
            "data shard; give each worker its own index"
        )
    return index


@dataclass
class Membership(Component):
    """Who took part in each sync (summary.json): quorum sizes, heals, retried syncs."""

    quorum_sizes: list[int] = field(default_factory=list)  # one per committed sync
    heals: int = 0  # syncs at which this worker adopted a peer's state
    retried_syncs: int = 0  # sync attempts that failed and were tried again
    dropped_syncs: int = 0  # syncs in flight (tau > 0) that failed: not applied, not retried

    def summary(self) -> dict[str, Any]:
        sizes = self.quorum_sizes
        return {
            "quorum_size_min": min(sizes) if sizes else None,
            "quorum_size_last": sizes[-1] if sizes else None,
            "heals": self.heals,
            "retried_syncs": self.retried_syncs,
            "dropped_syncs": self.dropped_syncs,
        }


class ElasticReducer:
    workers: int | None
    # all_gather only: a quorum's members are fixed for one sync, but a member that fails between
    # reduce_scatter's two collectives would leave its parts' means with no owner to send them, and a
    # healer joining a sync has no parts to own (docs/transport.md, "Backends").
    transports = ("all_gather",)
    # Its heal hands over the outer state at a quorum, where no sync is in flight; under eager updates the
    # consensus, from which the healer restarts its own (eager.py; reduce.py's Reducer).
    whole_window = eager_updates = True

    def __init__(self, section: TorchftBackendConfig, workers: int, topology: Topology | None = None) -> None:
        self.section, self.workers = section, workers
        # A worker of R ranks (topology.worker, a world of its own): its lead joins the quorums and passes
        # what it gets (a heal, the mean) on to the worker's other ranks.
        self.worker = topology.worker if topology is not None else None
        self.is_lead = topology is None or topology.is_lead
        if topology is not None and topology.num_workers != 1:
            raise UserError(
                f"a torchft worker of ranks_per_worker={topology.ranks_per_worker} ranks is a world of its "
                "own: start each worker's ranks with their own MASTER_PORT (muloco launch --backend torchft)"
            )
        R = topology.ranks_per_worker if topology is not None else 1
        self.index = replica_index(section, workers, R)
        self.group = None
        self.membership = Membership()
        self._state: SharedState | None = None
        self._replicas: list = []
        self._received: dict[str, Any] | None = None  # a peer's state, taken in during a quorum
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="muloco-torchft")  # syncs in flight
        self._dropped_in_a_row = 0
        self._syncing: Contribution | None = None  # the sync under way, whose fragment a healer joins
        self._shapes: list[list[torch.Size]] = []
        self._codecs: list[PseudogradientCodec] = []

    def local_replicas(self, workers: int) -> list[int]:
        return [self.index]

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        self._shapes, self._codecs = shapes_by_fragment, codecs
        if self.is_lead:
            self.group = TorchftGroup(self.section, self.index, self._serve_state, self._receive_state)

    def join(self, state: SharedState, replicas: list, resumed: bool) -> None:
        """Keep the run's state at hand (a heal replaces it); a resumed worker is at its checkpoint's sync
        count; a new run waits for its workers so the first quorum has them all."""
        self._state, self._replicas = state, replicas
        if not self.is_lead:
            return
        if resumed:
            self.group.set_step(state.fragment_syncs)
        expected = self.section.wait_for_workers or self.workers
        self.group.wait_for_workers(expected, self.section.join_timeout_s)

    # -- the state a healthy member serves and a healing one adopts ------------------------------------
    def _serve_state(self) -> dict[str, Any]:
        """Served during this member's quorum, i.e. at the start of a sync's mean. No other sync is in
        flight then (tau < H / P: each is applied before the next starts; a whole window, tau = H: the due
        one is applied once the new pseudogradient is taken, before its quorum), so the state is whole."""
        tensors, meta = self._state.export_state()
        syncing = self._syncing
        apply_step = syncing.apply_step if syncing.apply_step is not None else syncing.step
        meta = {**meta, "sync_fragment": syncing.fragment, "sync_apply_step": apply_step}
        copies = [t.detach().cpu().clone() for t in tensors]
        return {"tensors": copies, "meta": meta, "digest": state_digest(copies)}

    def _receive_state(self, received: dict[str, Any]) -> None:
        """A donor's state, checked against the digest it sent before it is adopted: a mismatch fails
        this quorum like a broken transfer (torchft_group.form_quorum), and the next one heals anew."""
        if state_digest(received["tensors"]) != received.get("digest"):
            raise ValueError("the healing state does not match its donor's digest (damaged in transfer)")
        self._received = received

    def _adopt_received(self, c: Contribution) -> Contribution | None:
        """After a heal: the adopted state in place, and this worker's (empty) part of the quorum's sync,
        which may be of another fragment than the one it planned."""
        if self._received is None:
            return None
        received, self._received = self._received, None
        meta = received["meta"]
        self._state.adopt_state(received["tensors"], meta, self._replicas)
        self.membership.heals += 1
        fragment = meta["sync_fragment"]
        log.warning(
            "torchft: worker=%d adopted the quorum's state live: step=%d outer_steps=%d, joining its sync "
            "of fragment %d (its own contribution is left out)",
            *(self.index, meta["step"], meta["outer_steps"], fragment),
        )
        return self._joining(c, fragment, meta["step"], meta["sync_apply_step"])

    def _joining(self, c: Contribution, fragment: int, step: int, apply_step: int) -> Contribution:
        """A healed worker's part of the quorum's sync: nothing, shaped like that fragment (the same
        aggregation rule as the others')."""
        template = c.like[0]
        like = [torch.zeros(s, dtype=template.dtype, device=template.device) for s in self._shapes[fragment]]
        codec = self._codecs[fragment] if self._codecs else None
        payload = 4.0 * sum(t.numel() for t in like) if codec is None else 0.0
        empty = {"healthy": 0, "like": like, "payload_bytes": payload, "delta_sum": None, "messages": []}
        return replace(c, fragment=fragment, step=step, codec=codec, apply_step=apply_step, **empty)

    # -- a sync ---------------------------------------------------------------------------------------
    def start_mean(self, contribution: Contribution) -> PendingMean:
        """The quorum's mean; a worker of R ranks: its lead's, passed on to the others (below)."""
        if self.worker is None:
            return self._start_mean(contribution)
        pending = self._start_mean(contribution) if self.is_lead else None
        moved = self._pass_heal_on(pending, contribution)
        shared = share_with_worker(self.worker, pending, (moved or contribution).like)
        shared.moved_to = moved
        return shared

    def _pass_heal_on(self, pending: PendingMean | None, c: Contribution) -> Contribution | None:
        """The lead tells the worker's other ranks whether it healed; if so they adopt the same state and
        join the same sync. Every rank of the worker calls the broadcasts, in the same order."""
        header = torch.zeros(4, dtype=torch.int64)  # healed, fragment, step, apply step
        moved = pending.moved_to if pending is not None else None
        if moved is not None:
            header[:] = torch.tensor([1, moved.fragment, moved.step, moved.apply_step])
        healed, fragment, step, apply_step = self.worker.broadcast([header], src=0).wait()[0].tolist()
        if not healed:
            return None
        tensors, meta = self._state.export_state()
        counters = torch.tensor([meta["step"], meta["outer_steps"], meta["fragment_syncs"]])
        tensors = self.worker.broadcast([t.clone() for t in tensors], src=0).wait()
        counters = self.worker.broadcast([counters], src=0).wait()[0].tolist()
        if self.is_lead:
            return moved
        meta = dict(zip(("step", "outer_steps", "fragment_syncs"), counters, strict=True))
        self._state.adopt_state(tensors, meta, self._replicas)
        return self._joining(c, fragment, step, apply_step)

    def _start_mean(self, contribution: Contribution) -> PendingMean:
        """Quorum (a worker behind adopts a member's state), then the collectives and the commit vote. A
        sync applied at once is retried in a new quorum when it fails. One applied tau steps later
        (Streaming DiLoCo) exchanges on the reducer's thread while the inner steps go on and votes when it
        is waited for; if it failed it is dropped, not retried: the others may have moved on by then."""
        c, attempts = contribution, self.section.quorum_retries + 1
        # Healed (its contribution, made before the heal, stays out) or absent: it has nothing to
        # contribute, and is not left out either. Only a heal moves the sync (to the quorum's).
        healed, moved, sent = c.absent, None, 0.0
        for attempt in range(1, attempts + 1):
            self._syncing = c
            try:
                self.group.form_quorum()
            except QuorumFailed as exc:
                self._retrying(c, attempt, attempts, f"no quorum ({exc})")
                continue
            joined = self._adopt_received(c)
            if joined is not None:
                c, healed, moved = joined, True, joined
            if c.apply_step is not None and c.apply_step > c.step:
                return self._in_background(c, healed, sent, moved)
            mean = self._exchange(c, healed)
            sent += mean.bytes_sent  # a failed attempt's bytes were sent too
            if self.group.commit():
                pending = PendingMean.completed(self._committed(mean, healed, sent))
                pending.moved_to = moved
                return pending
            self._retrying(c, attempt, attempts, f"quorum {self.group.quorum_id} of {self.group.size} failed")
        raise TrainingError(
            f"torchft: the sync at step {c.step} failed {attempts} times in a row (backend.torchft."
            "quorum_retries); check the lighthouse and the other workers' logs"
        )

    def _exchange(self, c: Contribution, healed: bool) -> Mean:
        return self._mean_uncompressed(c, healed) if c.codec is None else self._mean_compressed(c, healed)

    def _in_background(
        self, c: Contribution, healed: bool, sent: float, moved: Contribution | None
    ) -> PendingMean:
        """The collectives on the reducer's thread; the vote (on the caller's) when the mean is waited for.
        A sync that failed is dropped: the replicas keep their drift, which the fragment's next sync
        carries, and a member that missed a sync the others committed adopts their state at the next
        quorum (its sync count is behind theirs)."""

        def vote(mean: Mean) -> Mean:
            if self.group.commit():
                return self._committed(mean, healed, sent + mean.bytes_sent)
            return self._dropped(c, healed, sent + mean.bytes_sent)

        pending = PendingMean(_Background(self._thread.submit(self._exchange, c, healed)), vote)
        pending.moved_to = moved
        return pending

    def _committed(self, mean: Mean, healed: bool, sent: float) -> Mean:
        size = self.group.size
        self.membership.quorum_sizes.append(size)
        self._dropped_in_a_row = 0
        mean.bytes_sent = sent
        mean.details = {"quorum_size": size, "quorum_id": self.group.quorum_id, "healed": healed}
        return mean

    def _dropped(self, c: Contribution, healed: bool, sent: float) -> Mean:
        self.membership.dropped_syncs += 1
        self._dropped_in_a_row += 1
        size, quorum_id = self.group.size, self.group.quorum_id
        if self._dropped_in_a_row > self.section.quorum_retries:
            raise TrainingError(
                f"torchft: {self._dropped_in_a_row} syncs in a row failed (backend.torchft.quorum_retries); "
                "check the other workers' logs"
            )
        log.warning(
            "torchft: sync of fragment %d started at step %d failed in quorum %d of %d: dropped (the "
            "replicas keep their drift for the fragment's next sync)",
            *(c.fragment, c.step, quorum_id, size),
        )
        details = {"quorum_size": size, "quorum_id": quorum_id, "healed": healed, "dropped": True}
        return Mean(None, 0, 0, sent, details, dropped=True)

    def _retrying(self, c: Contribution, attempt: int, attempts: int, why: str) -> None:
        self.membership.retried_syncs += 1
        if attempt < attempts:
            log.warning(
                "torchft: sync of fragment %d at step %d: %s; retrying with a new quorum (attempt %d of %d)",
                *(c.fragment, c.step, why, attempt + 1, attempts),
            )
        else:
            log.error(
                "torchft: sync of fragment %d at step %d: %s; no attempts left", c.fragment, c.step, why
            )

    # Left out of a mean (the guard's count, as for collectives): members whose replica was non-finite.
    # Workers absent from the quorum are not (the quorum's size says so), nor is a member that healed:
    # it had nothing to contribute.

    def _mean_uncompressed(self, c: Contribution, healed: bool) -> Mean:
        """One all-reduce of [sum of this worker's healthy pseudogradients, their count, healed members]
        over the quorum, then / the count. A fresh buffer each attempt: the contribution stays intact."""
        count = 0 if healed else c.healthy
        parts = [torch.zeros_like(t) for t in c.like] if healed or c.delta_sum is None else c.delta_sum
        like = c.like[0]
        counts = torch.tensor([float(count), float(healed)], dtype=like.dtype, device=like.device)
        total = self.group.all_reduce_sum(torch.cat([t.reshape(-1) for t in parts] + [counts]))
        counted = total[-2:].tolist()
        if not all(map(math.isfinite, counted)):  # a failed collective's buffer: the commit vote fails
            return Mean(None, 0, 0)
        n, healed_members = (int(round(x)) for x in counted)
        values, offset = [], 0
        for t in c.like:
            values.append(total[offset : offset + t.numel()].view_as(t).div_(max(n, 1)))
            offset += t.numel()
        size = self.group.size
        sent = ring_allreduce_bytes(c.payload_bytes, size)
        return Mean(values if n > 0 else None, n, max(size - healed_members - n, 0), sent)

    def _mean_compressed(self, c: Contribution, healed: bool) -> Mean:
        """All-gather the members' messages (behind a healed flag); every member decodes all of them in
        quorum order."""
        capacity = 1 + c.codec.packed_bound([t.shape for t in c.like], 1)  # a worker's one message
        blobs = self.group.all_gather_bytes(bytes([healed]) + pack([] if healed else c.messages), capacity)
        values, seen = None, 0
        if blobs:  # none after a failed collective: the commit vote fails and the sync is retried
            messages = [blob[1:] for blob in blobs]
            values, seen = c.codec.decode_mean(messages, self.workers, c.like, c.aggregate, c.trim)
        healed_members = sum(blob[0] for blob in blobs)
        size = self.group.size
        sent = ring_allgather_bytes(c.payload_bytes, size)
        return Mean(values, seen, max(size - healed_members - seen, 0), sent)

    def after_sync(self, state: SharedState, mean: Mean, replicas: list) -> None:
        pass  # a worker behind is healed at the next quorum

    def conclude(self, state: SharedState, replicas: list) -> dict[str, Any]:
        return {}  # each quorum's members commit the same mean (or none)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.close()


class _Background:
    """A handle on collectives running on the reducer's thread."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> Mean:
        return self.future.result()
