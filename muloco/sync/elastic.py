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
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from muloco.comm import ring_allgather_bytes, ring_allreduce_bytes
from muloco.comm.torchft_group import QuorumFailed, TorchftGroup
from muloco.config import TorchftBackendConfig
from muloco.errors import TrainingError, UserError
from muloco.run_state import Component
from muloco.sync.codec import PseudogradientCodec, pack
from muloco.sync.reduce import Contribution, Mean, PendingMean, SharedState

log = logging.getLogger("muloco")


def replica_index(section: TorchftBackendConfig, workers: int) -> int:
    """This worker's replica index: backend.torchft.replica_id, else the launcher's RANK, else 0."""
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

    def summary(self) -> dict[str, Any]:
        sizes = self.quorum_sizes
        return {
            "quorum_size_min": min(sizes) if sizes else None,
            "quorum_size_last": sizes[-1] if sizes else None,
            "heals": self.heals,
            "retried_syncs": self.retried_syncs,
        }


class ElasticReducer:
    workers: int | None

    def __init__(self, section: TorchftBackendConfig, workers: int) -> None:
        self.section, self.workers = section, workers
        self.index = replica_index(section, workers)
        self.group = None
        self.membership = Membership()
        self._state: SharedState | None = None
        self._replicas: list = []
        self._received: dict[str, Any] | None = None  # a peer's state, taken in during a quorum

    def local_replicas(self, workers: int) -> list[int]:
        return [self.index]

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        self.group = TorchftGroup(self.section, self.index, self._serve_state, self._receive_state)

    def join(self, state: SharedState, replicas: list, resumed: bool) -> None:
        """Keep the run's state at hand (a heal replaces it); a resumed worker is at its checkpoint's sync
        count; a new run waits for its workers so the first quorum has them all."""
        self._state, self._replicas = state, replicas
        if resumed:
            self.group.set_step(state.fragment_syncs)
        expected = self.section.wait_for_workers or self.workers
        self.group.wait_for_workers(expected, self.section.join_timeout_s)

    # -- the state a healthy member serves and a healing one adopts ------------------------------------
    def _serve_state(self) -> dict[str, Any]:
        tensors, meta = self._state.export_state()
        return {"tensors": [t.detach().cpu().clone() for t in tensors], "meta": dict(meta)}

    def _receive_state(self, received: dict[str, Any]) -> None:
        self._received = received

    def _adopt_received(self) -> bool:
        if self._received is None:
            return False
        received, self._received = self._received, None
        meta = received["meta"]
        self._state.adopt_state(received["tensors"], meta, self._replicas)
        self.membership.heals += 1
        log.warning(
            "torchft: worker=%d adopted the quorum's state live: step=%d outer_steps=%d (its contribution "
            "to this sync is left out)",
            *(self.index, meta["step"], meta["outer_steps"]),
        )
        return True

    # -- a sync ---------------------------------------------------------------------------------------
    def start_mean(self, contribution: Contribution) -> PendingMean:
        """Quorum, heal if behind, collectives, commit vote; a failed attempt is retried in a new quorum."""
        c, attempts = contribution, self.section.quorum_retries + 1
        healed, sent = False, 0.0  # once healed, its contribution (made before the heal) stays out
        for attempt in range(1, attempts + 1):
            try:
                self.group.form_quorum()
            except QuorumFailed as exc:
                self._retrying(c, attempt, attempts, f"no quorum ({exc})")
                continue
            healed = self._adopt_received() or healed
            size = self.group.size
            mean = self._mean_uncompressed(c, healed) if c.codec is None else self._mean_compressed(c, healed)
            sent += mean.bytes_sent  # a failed attempt's bytes were sent too
            if self.group.commit():
                self.membership.quorum_sizes.append(size)
                mean.bytes_sent = sent
                mean.details = {"quorum_size": size, "quorum_id": self.group.quorum_id, "healed": healed}
                return PendingMean.completed(mean)
            self._retrying(c, attempt, attempts, f"quorum {self.group.quorum_id} of {size} failed")
        raise TrainingError(
            f"torchft: the sync at step {c.step} failed {attempts} times in a row (backend.torchft."
            "quorum_retries); check the lighthouse and the other workers' logs"
        )

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
        blobs = self.group.all_gather_bytes(bytes([healed]) + pack([] if healed else c.messages))
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

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
