"""`SwarmReducer`: the sync engine's reducer over a hivemind swarm (backend.kind=hivemind; docs/backends.md).

A peer hosts one replica (its data shard is `peer_index`) and averages with whichever peers are present.
The reducer turns the engine's contributions into swarm syncs, serves the run's state to joiners, publishes
its progress and, when it has fallen behind or found no group while others did, loads the swarm's state
(through the engine's `SharedState`). The swarm mechanics (DHT, matchmaking, payload exchange, checks) are
`HivemindSwarm`'s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from muloco.config import HivemindBackendConfig
from muloco.errors import TrainingError, UserError
from muloco.net.parent_death import die_with_parent
from muloco.sync.codec import PseudogradientCodec, unpack
from muloco.sync.deadline import RoundDeadline
from muloco.sync.late_windows import JoinedLate, LateWindows
from muloco.sync.reduce import Contribution, Mean, PendingMean, SharedState

log = logging.getLogger("muloco")

# How long a peer that must realign keeps asking (its donor may still be finishing the same sync), and how
# many loads it tries in a row (after a load it looks again: the swarm may have moved on meanwhile).
REALIGN_WAIT_S = 10.0
CATCH_UP_WAIT_S = 0.6
REALIGN_ATTEMPTS = 40


def _reference(digests: dict[str, bytes], own: bytes) -> tuple[str, bytes] | None:
    """When this peer holds another model than its group's majority: the member whose state it should load
    and that member's digest; None when it agrees. The majority digest is the one most members announced
    (a tie goes to the digest whose lowest holder has the lowest peer id), the reference member its holder
    with the lowest peer id. Every member sees the same metadata, so all pick the same: only the minority
    reloads, and all of it from one peer."""
    if not digests or own not in digests.values():
        return None  # no digests to compare (or this peer's own is missing: nothing to decide from)
    holders: dict[bytes, list[str]] = {}
    for peer in sorted(digests, key=lambda p: _peer(p).to_bytes()):
        if digests[peer]:  # an empty digest: a late window's peer (sync.deadline), which takes the group's
            holders.setdefault(digests[peer], []).append(peer)
    if not holders:
        return None
    majority = max(holders.values(), key=len)  # max keeps the first of equals: the lowest first holder
    reference = majority[0]
    return None if digests[reference] == own else (reference, digests[reference])


def _backed_digests(records: dict, min_progress: int, quorum: int) -> set[bytes]:
    """The state digests that at least `quorum` peers announce at one progress >= min_progress."""
    counts: dict[tuple[int, bytes], int] = {}
    for record in records.values():
        if record.progress >= min_progress and record.digest:
            key = (record.progress, record.digest)
            counts[key] = counts.get(key, 0) + 1
    return {digest for (_, digest), n in counts.items() if n >= quorum}


def _peer(peer_id: str):
    from hivemind.p2p import PeerID

    return PeerID.from_base58(peer_id)


def peer_index(section: HivemindBackendConfig, workers: int) -> int:
    """This peer's replica index: backend.hivemind.peer_index, else the launcher's RANK, else 0."""
    index = section.peer_index
    if index is None:
        index = int(os.environ.get("RANK", "0"))
    if not 0 <= index < workers:
        raise UserError(
            f"backend.hivemind.peer_index ({index}) must be below workers ({workers}): it picks this "
            "peer's data shard; give each peer its own index"
        )
    return index


class SwarmReducer(LateWindows):
    # A swarm's group changes every sync (matchmaking), so no part has a fixed owner: all_gather only.
    transports = ("all_gather",)
    # Its catch-up hands a peer's state over at any time (a whole window keeps a sync in flight at all
    # times) and one outer state (reduce.py's Reducer).
    whole_window = eager_updates = False

    def __init__(
        self,
        section: HivemindBackendConfig,
        workers: int | None = None,
        tolerate: int = 0,
        deadline: RoundDeadline | None = None,
        every: int = 0,
        total_steps: int | None = None,
    ) -> None:
        """workers: K of `muloco train` (the peer indices' range, the WAN projection); None in the Python
        API, where the swarm's size is whoever is present. tolerate: bad members the run defends against
        (sync.trim with a robust sync.aggregate, else 0): a progress claim or a state counts only when
        tolerate + 1 peers' records back it, so that many insiders cannot make honest peers reload theirs.
        deadline: sync.deadline: adaptive (deadline.py), with every = H, the inner steps between syncs, and
        the run's total_steps (its last sync's step)."""
        self.section, self.workers, self.tolerate = section, workers, tolerate
        self.swarm = None
        self.digest = b""  # this peer's global state digest, announced to its groups and in its progress
        # sync.deadline: adaptive: the round times and the late and lost windows (summary.json)
        self.membership, self.every, self.total_steps = deadline, every, total_steps
        self._round_started: float | None = None  # monotonic: when this peer's round began
        self._state: SharedState | None = None  # the engine's, and the replicas (join)
        self._replicas: list = []
        self._progress = 0  # this peer's fragment syncs when its round began

    def local_replicas(self, workers: int) -> list[int]:
        return [peer_index(self.section, workers)]  # one replica per peer: its data shard

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        from muloco.comm.hivemind import HivemindSwarm

        # hivemind forks its DHT and averagers: have them die with this process even if it is SIGKILLed.
        os.register_at_fork(after_in_child=die_with_parent)
        compression = [codec.compressors for codec in codecs] if codecs else None
        section = self.section
        if self.membership is not None and section.target_group_size is None and self.workers:
            # A group of every worker begins at once; only a missing one is waited for, until the deadline.
            section = section.model_copy(update={"target_group_size": self.workers})
        try:
            self.swarm = HivemindSwarm(section, shapes_by_fragment, compression)
        except UserError:
            raise  # a bad key file, a peer list without this peer: already one line naming the field
        except Exception as exc:  # the p2p daemon cannot bind, an initial peer is unreachable, ...
            raise UserError(
                f"backend.hivemind: could not start or join the swarm ({type(exc).__name__}: {exc}); check "
                "backend.hivemind.host_maddrs and initial_peers"
            ) from None

    # -- joining --------------------------------------------------------------------------------------
    def join(self, state: SharedState, replicas: list, resumed: bool) -> None:
        """A peer joining a running swarm (and without a checkpoint of its own) first loads the swarm's
        global parameters, outer momentum and step counters; then it serves its own to later joiners and
        waits for backend.hivemind.wait_for_peers peers."""
        if not resumed and self.section.initial_peers:
            self._load(state, replicas)
        self._serve(state)
        self._wait_for_peers(state.fragment_syncs)
        self._state, self._replicas = state, replicas  # sync.deadline: a late window's peer takes the state
        self._begin_round(state)

    def _load(
        self,
        state: SharedState,
        replicas: list,
        donor=None,
        min_progress: int = 0,
        digests: set[bytes] | None = None,
        timeout: float | None = None,
        skip_steps: int = 0,
    ) -> bool:
        """Global parameters, outer momentum and step counters from a peer (the one given, else the one
        furthest ahead; one of these digests when given; within timeout, else join_timeout_s); the
        replicas restart there. skip_steps: the step counter set that many steps past the donor's."""
        like, _ = state.export_state()
        donors = None if donor is None else [donor]
        if digests is None and self.tolerate:
            digests = _backed_digests(self.swarm.peer_records(), min_progress, self.tolerate + 1)
            if not digests:
                log.info(
                    "hivemind: no state at progress >= %d that %d peers announce",
                    min_progress,
                    self.tolerate + 1,
                )
                return False
        timeout = self.section.join_timeout_s if timeout is None else timeout
        found = self.swarm.load_state_from_peers(like, timeout, donors, min_progress, digests)
        if found is None:
            return False
        tensors, meta, source = found
        meta = {**meta, "step": meta["step"] + skip_steps}
        state.adopt_state(tensors, meta, replicas)
        log.info(
            "hivemind: loaded the state of peer=%s: step=%d outer_steps=%d",
            *(source, meta["step"], meta["outer_steps"]),
        )
        return True

    def _serve(self, state: SharedState) -> None:
        """Serve a copy of this peer's state to other peers (taken between syncs: never half-updated)."""
        self.digest = self.swarm.share_state(*state.export_state())

    def _wait_for_peers(self, progress: int) -> None:
        """Publish this peer, then wait until backend.hivemind.wait_for_peers peers are there (at most
        join_timeout_s): peers that a launcher starts together then begin in step."""
        self.swarm.publish_outer_step(progress, self.digest)
        deadline = time.monotonic() + self.section.join_timeout_s
        while (present := len(self.swarm.peer_outer_steps())) < self.section.wait_for_peers:
            if time.monotonic() > deadline:
                log.warning(
                    "hivemind: %d of backend.hivemind.wait_for_peers=%d peers after %.0f s: starting anyway",
                    present,
                    self.section.wait_for_peers,
                    self.section.join_timeout_s,
                )
                return
            time.sleep(0.2)

    # -- a sync ---------------------------------------------------------------------------------------
    def start_mean(self, contribution: Contribution) -> PendingMean:
        """Average with the peers present. A peer whose replica was left out (non-finite) sits out."""
        c = contribution
        if c.healthy == 0:
            return PendingMean.completed(Mean(None, 0, left_out=1, details={"group_size": 1}))
        me = str(self.swarm.peer_id)
        if self.membership is not None:
            return self._start_with_deadline(c, me)
        handle = self._average(c, c.step, self.digest)
        return PendingMean(handle, self._mean_of(c, self.digest, me))

    def _average(self, c: Contribution, step: int, digest: bytes, wait_s: float = 0.0, late: bool = False):
        rule = (c.aggregate, c.trim)
        if c.codec is None:
            return self.swarm.start_average(c.fragment, c.delta_sum, step, rule, digest, wait_s, late)
        payloads = unpack(c.messages[0])
        return self.swarm.start_average_encoded(c.fragment, payloads, step, rule, digest, wait_s, late)

    @staticmethod
    def _mean_of(
        c: Contribution, digest: bytes, me: str, joined: JoinedLate | None = None
    ) -> Callable[[object], Mean]:
        """joined (sync.deadline): which sync the window went to, and the digest it announced there."""

        def finish(result) -> Mean:
            announced = joined.digest if joined is not None else digest
            if result.excluded_reasons:
                log.warning("hivemind: contributions excluded: %s", result.excluded_reasons)
            if not result.averaged:
                outcome = "applying this peer's own pseudogradient" if result.mean is not None else "skipping"
                log.warning("hivemind: no group for fragment %d at step %d: %s", c.fragment, c.step, outcome)
            # Each member uploads its payload to every other member of the group (a mesh all-gather).
            sent = (result.group_size - 1) * c.payload_bytes
            details = {"group_size": result.group_size, "state_digest": announced.hex()}
            if joined is not None and joined.late:  # the window joined the sync after the one it was due at
                details["late"], details["joined_step"] = True, joined.step
            if joined is not None and joined.lost:  # counted by LateWindows
                details["lost_window"] = True
            if result.behind_group:
                details["behind_group"] = True
            reference = _reference(result.digests, announced)
            if reference is not None:  # JSON-friendly: the details are logged with the sync
                details["state_reference"], details["state_reference_digest"] = (
                    reference[0],
                    reference[1].hex(),
                )
            # Only this peer's own non-finite contribution is left out in the guard's sense; the others'
            # exclusions (another step, a failed download, a malformed payload) are counted by kind.
            left_out, excluded = result.exclusions(me)
            return Mean(result.mean, result.contributors, left_out, sent, details, excluded=excluded)

        return finish

    # -- after a sync: catch up, or realign with the group ------------------------------------------
    def after_sync(self, state: SharedState, mean: Mean, replicas: list) -> None:
        """Catch up or realign (below); with a deadline, count who was missing and begin the next round."""
        if self.membership is not None and self.workers:
            self.membership.absent += max(0, self.workers - int(mean.details.get("group_size", 1)))
        self._realign(state, mean, replicas)
        if self.membership is not None:
            self._begin_round(state)

    def _realign(self, state: SharedState, mean: Mean, replicas: list) -> None:
        """A peer that is behind the swarm (it cannot average with peers at another step), that found no
        group while other peers are there (it applied its own pseudogradient, so its global parameters left
        the swarm's), or whose group showed it holds another model than its reference member (e.g. it
        left out a contribution that the others averaged) loads a peer's state and continues from there."""
        missed_group = mean.details.get("group_size") == 1
        # Its group's members were a sync ahead: they publish that progress only once they finish this
        # round, so without this a peer one sync behind meets them every round, is excluded every round
        # and never sees itself behind (seen over a 20 ms link: 141 of 150 syncs, docs/reliability.md).
        behind_group = bool(mean.details.get("behind_group"))
        reference = mean.details.get("state_reference")  # a peer id when this peer's state differs
        if missed_group:  # it went its own way: it does not offer that state, but announces it truthfully
            from muloco.comm.digest import state_digest

            self.digest = state_digest(state.export_state()[0])
        else:
            self._serve(state)
        # Realigning with the group's reference, whose donor is finishing the same sync: wait for it a
        # while. Behind or without a group: the donors have long served their state, a few looks do.
        deadline = time.monotonic() + (REALIGN_WAIT_S if reference or behind_group else CATCH_UP_WAIT_S)
        for _ in range(REALIGN_ATTEMPTS):  # a donor may still serve the previous sync's state: look again
            progress = state.fragment_syncs
            self.swarm.publish_outer_step(progress, self.digest)
            ahead = self._swarm_progress(progress)
            behind = ahead > progress or behind_group
            realign = missed_group and self._others_in_step(progress)
            if not (behind or realign or reference):
                return
            if not state.can_adopt():
                if reference:  # not silent: a streaming sync still in flight, or the run's last sync
                    log.warning(
                        "hivemind: this peer's global state differs from its group's majority (peer=%s) and "
                        "cannot be realigned now (a sync in flight, or the run's end: then the final "
                        "agreement realigns it)",
                        reference,
                    )
                return
            if reference and not behind:
                log.warning(
                    "hivemind: this peer's global state differed from its group's majority before progress "
                    "%d (digest %s, this peer's %s): loading the state of peer=%s",
                    *(
                        progress,
                        mean.details["state_reference_digest"],
                        mean.details["state_digest"],
                        reference,
                    ),
                )
                # A late window's peer applied the group's mean to its state of a sync before: it takes
                # the reference's after that sync (one more than its own count).
                late = int(bool(mean.details.get("late")))
                loaded = self._load(state, replicas, _peer(reference), min_progress=progress + late)
            else:
                why = (
                    f"is behind ({progress} syncs, the swarm {ahead})"
                    if ahead > progress
                    else f"is a sync behind its group ({progress} syncs)"
                    if behind
                    else "found no group"
                )
                log.warning("hivemind: this peer %s: loading the swarm's state", why)
                loaded = self._load(state, replicas, min_progress=progress + 1 if behind else progress)
            if loaded:
                self._serve(state)
                missed_group, reference, behind_group = False, None, False
            if time.monotonic() > deadline:
                if not loaded:
                    log.warning(
                        "hivemind: could not load a peer's state in time: trying again after the next sync"
                    )
                return
            if not loaded:
                time.sleep(0.25)

    # -- the end of the run: a final agreement ------------------------------------------------------
    def conclude(self, state: SharedState, replicas: list) -> dict[str, Any]:
        """After the last sync every peer publishes its final digest and waits (at most 2 x the
        averaging timeout) until every peer still running has too. A peer whose model differs from the
        majority's (the rule of `_reference`) loads the majority's state from its reference member; the
        others keep serving theirs meanwhile. A peer that still differs at the deadline raises
        TrainingError: it must not end "completed" with a model the others do not have."""
        final, me = state.fragment_syncs, str(self.swarm.peer_id)
        wait_s = 2.0 * max(t.averaging_timeout for t in self.swarm.timeouts)
        self._serve(state)  # also a peer that went its own way: loaders ask for a digest, not a peer
        deadline, realigned = time.monotonic() + wait_s, False
        while True:
            self.swarm.publish_outer_step(final, self.digest)
            finished, running = self._final_digests(final, wait_s)
            finished[me] = self.digest
            reference = _reference(finished, self.digest)
            if reference is None and len(set(finished.values())) == 1 and not running:
                break  # everyone still running holds this model
            if reference is not None:
                log.warning(
                    "hivemind: this peer's final model differs from the swarm's majority (%d of %d peers "
                    "agree on another): loading the state of peer=%s",
                    *(list(finished.values()).count(reference[1]), len(finished), reference[0]),
                )
                left = max(1.0, deadline - time.monotonic())
                if self._load(state, replicas, _peer(reference[0]), final, {reference[1]}, left):
                    self._serve(state)  # the others see it agree at the next look
                    realigned, reference, finished[me] = True, None, self.digest
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)
        if reference is not None:
            raise TrainingError(
                f"hivemind: this peer's final model differs from the swarm's majority and it could not load "
                f"the majority's state (peer={reference[0]}) within {wait_s:.0f} s; its own model is in the "
                "last checkpoint. Resume with the swarm running (checkpoint.resume=auto) to realign it"
            )
        if len(set(finished.values())) > 1:
            log.warning(
                "hivemind: peers still differ at the end (%d models); this one holds the majority's",
                len(set(finished.values())),
            )
        return {"final_state_digest": self.digest.hex(), "realigned_at_end": realigned}

    def _final_digests(self, final: int, fresh_s: float) -> tuple[dict[str, bytes], list[str]]:
        """The digests of the peers that finished (published `final`), and the peers still running (behind,
        with a record published within fresh_s; an older one is a peer that left)."""
        from hivemind.utils.timed_storage import get_dht_time

        now = get_dht_time()
        finished, running = {}, []
        for peer, record in self.swarm.peer_records().items():
            if record.progress == final and record.digest:
                finished[str(peer)] = record.digest
            elif record.progress < final and now - record.published < fresh_s:
                running.append(str(peer))
        return finished, running

    def _swarm_progress(self, progress: int) -> int:
        """The swarm's progress as this peer trusts it: the (tolerate + 1)-th highest that other peers
        published (so `tolerate` insiders cannot claim it), or this peer's own if fewer published."""
        me = str(self.swarm.peer_id)
        others = sorted((p for peer, p in self.swarm.peer_outer_steps().items() if peer != me), reverse=True)
        return max(progress, others[self.tolerate]) if len(others) > self.tolerate else progress

    def _others_in_step(self, progress: int) -> bool:
        """Whether another peer has published at least this progress (it synced this round without us; a
        dead peer's entry stays behind, so it does not count)."""
        me = str(self.swarm.peer_id)
        return any(step >= progress for peer, step in self.swarm.peer_outer_steps().items() if peer != me)

    def close(self) -> None:
        if self.swarm is not None:
            self.swarm.close()
