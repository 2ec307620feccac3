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

import torch

from muloco.config import HivemindBackendConfig
from muloco.errors import UserError
from muloco.launch import die_with_parent
from muloco.sync.codec import PseudogradientCodec, unpack
from muloco.sync.reduce import Contribution, Mean, PendingMean, SharedState

log = logging.getLogger("muloco")


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


class SwarmReducer:
    def __init__(self, section: HivemindBackendConfig, workers: int | None = None) -> None:
        """workers: K of `muloco train` (the peer indices' range, the WAN projection); None in the Python
        API, where the swarm's size is whoever is present."""
        self.section, self.workers = section, workers
        self.swarm = None
        self.served: tuple[list[torch.Tensor], dict] | None = None

    def local_replicas(self, workers: int) -> list[int]:
        return [peer_index(self.section, workers)]  # one replica per peer: its data shard

    def open(self, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]) -> None:
        from muloco.comm.hivemind import HivemindSwarm

        # hivemind forks its DHT and averagers: have them die with this process even if it is SIGKILLed.
        os.register_at_fork(after_in_child=die_with_parent)
        compression = [codec.compressors for codec in codecs] if codecs else None
        try:
            self.swarm = HivemindSwarm(self.section, shapes_by_fragment, compression)
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

    def _load(self, state: SharedState, replicas: list) -> bool:
        """Global parameters, outer momentum and step counters from a peer; the replicas restart there."""
        found = self.swarm.load_state_from_peers(self.section.join_timeout_s)
        if found is None:
            return False
        tensors, meta = found
        state.adopt_state(tensors, meta, replicas)
        log.info(
            "hivemind: loaded the swarm's state: step=%d outer_steps=%d", meta["step"], meta["outer_steps"]
        )
        return True

    def _serve(self, state: SharedState) -> None:
        """Keep a copy of this peer's state for joiners (taken between syncs: never half-updated)."""
        tensors, meta = state.export_state()
        first = self.served is None
        self.served = ([t.detach().cpu().clone() for t in tensors], dict(meta))
        if first:
            self.swarm.share_state(lambda: self.served)

    def _wait_for_peers(self, progress: int) -> None:
        """Publish this peer, then wait until backend.hivemind.wait_for_peers peers are there (at most
        join_timeout_s): peers that a launcher starts together then begin in step."""
        self.swarm.publish_outer_step(progress)
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
        if c.codec is None:
            handle = self.swarm.start_average(c.fragment, c.delta_sum, c.step)
        else:
            handle = self.swarm.start_average_encoded(c.fragment, unpack(c.messages[0]), c.step)
        return PendingMean(handle, self._mean_of(c))

    @staticmethod
    def _mean_of(c: Contribution) -> Callable[[object], Mean]:
        def finish(result) -> Mean:
            if result.excluded_reasons:
                log.warning("hivemind: contributions excluded: %s", result.excluded_reasons)
            if not result.averaged:
                outcome = "applying this peer's own pseudogradient" if result.mean is not None else "skipping"
                log.warning("hivemind: no group for fragment %d at step %d: %s", c.fragment, c.step, outcome)
            # Each member uploads its payload to every other member of the group (a mesh all-gather).
            sent = (result.group_size - 1) * c.payload_bytes
            details = {"group_size": result.group_size}
            return Mean(result.mean, result.contributors, result.excluded, sent, details)

        return finish

    # -- after a sync: catch up -----------------------------------------------------------------------
    def after_sync(self, state: SharedState, mean: Mean, replicas: list) -> None:
        """A peer that is behind the swarm (it cannot average with peers at another step), or that found no
        group while other peers are there (it applied its own pseudogradient, so its global parameters left
        the swarm's), loads the swarm's state and continues from there."""
        missed_group = mean.details.get("group_size") == 1
        if not missed_group:
            self._serve(state)  # a peer that went its own way does not offer its state to joiners
        for _ in range(3):  # a donor may still hold the previous sync's state: look again
            progress = state.fragment_syncs
            self.swarm.publish_outer_step(progress)
            ahead = max(self.swarm.peer_outer_steps().values(), default=progress)
            behind = ahead > progress
            realign = missed_group and self._others_in_step(progress)
            if not (behind or realign) or not state.can_adopt():
                return
            why = f"is behind ({progress} syncs, the swarm {ahead})" if behind else "found no group"
            log.warning("hivemind: this peer %s: loading the swarm's state", why)
            if not self._load(state, replicas):
                return
            self._serve(state)
            missed_group = False
            time.sleep(0.2)

    def _others_in_step(self, progress: int) -> bool:
        """Whether another peer has published at least this progress (it synced this round without us; a
        dead peer's entry stays behind, so it does not count)."""
        me = str(self.swarm.peer_id)
        return any(step >= progress for peer, step in self.swarm.peer_outer_steps().items() if peer != me)

    def close(self) -> None:
        if self.swarm is not None:
            self.swarm.close()
