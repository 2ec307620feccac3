"""The trainer's side of a hivemind swarm (backend.kind=hivemind; docs/backends.md).

A peer hosts one replica (its data shard is `peer_index`) and averages with whichever peers are present.
`SwarmPeer` turns the trainer's pseudogradients into swarm syncs, serves the peer's state to joiners,
publishes its progress and tells the trainer when it has fallen behind. The swarm mechanics (DHT,
matchmaking, payload exchange, checks) live in `muloco.comm.hivemind`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from muloco.codec import PseudogradientCodec, unpack
from muloco.comm import CompletedHandle
from muloco.errors import UserError
from muloco.launch import die_with_parent
from muloco.reduce import Mean, PendingMean

log = logging.getLogger("muloco")

State = tuple[list[torch.Tensor], dict]  # (global parameters + outer momentum, step counters)


def peer_index(cfg) -> int:
    """This peer's replica index: backend.hivemind.peer_index, else the launcher's RANK, else 0."""
    index = cfg.backend.hivemind.peer_index
    if index is None:
        index = int(os.environ.get("RANK", "0"))
    if not 0 <= index < cfg.workers:
        raise UserError(
            f"backend.hivemind.peer_index ({index}) must be below workers ({cfg.workers}): it picks this "
            "peer's data shard; give each peer its own index"
        )
    return index


class SwarmPeer:
    def __init__(
        self, cfg, shapes_by_fragment: list[list[torch.Size]], codecs: list[PseudogradientCodec]
    ) -> None:
        from muloco.comm.hivemind import HivemindSettings, HivemindSwarm

        self.section = cfg.backend.hivemind
        # hivemind forks its DHT and averagers: have them die with this process even if it is SIGKILLed.
        os.register_at_fork(after_in_child=die_with_parent)
        settings = HivemindSettings(
            **self.section.model_dump(exclude={"peer_index", "join_timeout_s", "wait_for_peers"})
        )
        compression = [codec.compressors for codec in codecs] if codecs else None
        try:
            self.swarm = HivemindSwarm(settings, shapes_by_fragment, compression)
        except Exception as exc:  # the p2p daemon cannot bind, an initial peer is unreachable, ...
            raise UserError(
                f"backend.hivemind: could not start or join the swarm ({type(exc).__name__}: {exc}); check "
                "backend.hivemind.host_maddrs and initial_peers"
            ) from None
        self.state: State | None = None

    # -- joining --------------------------------------------------------------------------------------
    def load_state(self) -> State | None:
        """The swarm's global state from a peer (None: no peer shares one, e.g. a new swarm)."""
        return self.swarm.load_state_from_peers(self.section.join_timeout_s)

    def serve(self, tensors: list[torch.Tensor], meta: dict) -> None:
        """Keep a copy of this peer's state for joiners (taken between syncs: never half-updated)."""
        first = self.state is None
        self.state = ([t.detach().cpu().clone() for t in tensors], dict(meta))
        if first:
            self.swarm.share_state(lambda: self.state)

    def wait_for_peers(self, progress: int) -> None:
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

    def publish_and_check(self, progress: int) -> int | None:
        """Publish this peer's progress (fragment syncs done); the swarm's highest if this peer is behind."""
        self.swarm.publish_outer_step(progress)
        ahead = max(self.swarm.peer_outer_steps().values(), default=progress)
        return ahead if ahead > progress else None

    def others_in_step(self, progress: int) -> bool:
        """Whether another peer has published at least this progress (it synced this round without us; a
        dead peer's entry stays behind, so it does not count)."""
        me = str(self.swarm.peer_id)
        return any(step >= progress for peer, step in self.swarm.peer_outer_steps().items() if peer != me)

    # -- a sync ---------------------------------------------------------------------------------------
    def start_mean(
        self,
        fragment: int,
        step: int,
        delta_sum: list[torch.Tensor] | None,
        codec: PseudogradientCodec | None,
        messages: list[bytes],
        healthy: int,
    ) -> PendingMean:
        """Average with the peers present. A peer whose replica was left out (non-finite) sits out."""
        if healthy == 0:
            return PendingMean(CompletedHandle(None), lambda _: Mean(None, 0, left_out=1, group_size=1))
        if codec is None:
            handle = self.swarm.start_average(fragment, delta_sum, step)
        else:
            handle = self.swarm.start_average_encoded(fragment, unpack(messages[0]), step)
        return PendingMean(handle, self._mean_of(fragment, step))

    @staticmethod
    def _mean_of(fragment: int, step: int) -> Callable[[object], Mean]:
        def finish(result) -> Mean:
            if result.excluded_reasons:
                log.warning("hivemind: contributions excluded: %s", result.excluded_reasons)
            if not result.averaged:
                outcome = "applying this peer's own pseudogradient" if result.mean is not None else "skipping"
                log.warning("hivemind: no group for fragment %d at step %d: %s", fragment, step, outcome)
            return Mean(
                result.mean, result.contributors, left_out=result.excluded, group_size=result.group_size
            )

        return finish

    def close(self) -> None:
        self.swarm.close()
