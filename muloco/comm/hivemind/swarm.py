"""`HivemindSwarm`: one peer's membership of a hivemind swarm, put together from its parts.

lifecycle.py starts and stops what it runs on, exchange.py runs the syncs (its docstring walks through one),
transfer.py moves the payloads, state_sharing.py serves and loads the global state, progress.py keeps the
peers' outer steps in the DHT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from hivemind.p2p import PeerID

from muloco.comm.hivemind import state_sharing
from muloco.comm.hivemind.exchange import AveragingHandle, FragmentSync
from muloco.comm.hivemind.lifecycle import SwarmRuntime, require_fork_start_method
from muloco.comm.hivemind.payloads import _adapters
from muloco.comm.hivemind.progress import ProgressRecords
from muloco.comm.hivemind.settings import derive_timeouts, is_loopback
from muloco.comm.hivemind.transfer import PayloadServer, handler_name
from muloco.compress import Compressor
from muloco.config import HivemindBackendConfig

log = logging.getLogger("muloco")


class HivemindSwarm:
    """This peer's membership of a hivemind swarm: one averager per fragment, state sharing, outer steps.

    Build it in the main thread (hivemind installs signal handlers), with the fork start method.
    settings: the config section backend.hivemind (the swarm ignores the trainer's fields, e.g. peer_index).
    tensor_shapes_by_fragment[p] lists the shapes of fragment p's tensors (plain DiLoCo: one fragment).
    compression: None (fp32, bit-exact), one Compressor for every tensor, or one per tensor
    (list per fragment, e.g. a PseudogradientCodec's compressors). Every peer must use the same.
    """

    def __init__(
        self,
        settings: HivemindBackendConfig,
        tensor_shapes_by_fragment: list[list[torch.Size]],
        compression: Compressor | list[list[Compressor]] | None = None,
    ) -> None:
        require_fork_start_method()
        self.settings = settings
        self.shapes = [[torch.Size(s) for s in fragment] for fragment in tensor_shapes_by_fragment]
        if not self.shapes or not all(self.shapes):
            raise ValueError("tensor_shapes_by_fragment needs at least one fragment, each with a tensor")
        self.codecs = _adapters(compression, self.shapes)
        loopback = is_loopback(settings.host_maddrs + settings.initial_peers + settings.announce_maddrs)
        self.timeouts = [
            derive_timeouts(
                sum(c.compressor.payload_nbytes(tuple(s)) for c, s in zip(codecs, shapes, strict=True)),
                settings.bandwidth_mbps,
                settings.target_group_size,
                loopback,
                settings.matchmaking_time,
                settings.averaging_timeout,
            )
            for codecs, shapes in zip(self.codecs, self.shapes, strict=True)
        ]
        self.payloads = PayloadServer(len(self.shapes))
        self.runtime = SwarmRuntime()
        self._closed = False
        handlers = {
            handler_name(settings.run_id, p): partial(self.payloads.serve, p) for p in range(len(self.shapes))
        }
        try:
            self.runtime.start(settings, self.timeouts, handlers)
        except BaseException:
            self.close()  # stops whatever had started: no orphan DHT, averager or p2p daemon
            raise
        self.peer_id: PeerID = self.runtime.peer_id
        self.visible_maddrs: list[str] = self.runtime.visible_maddrs
        self.fragments = [
            FragmentSync(
                fragment=p,
                shapes=self.shapes[p],
                codecs=self.codecs[p],
                timeouts=self.timeouts[p],
                settings=settings,
                peer_id=self.peer_id,
                averager=self.runtime.averagers[p],
                payloads=self.payloads,
                runtime=self.runtime,
            )
            for p in range(len(self.shapes))
        ]
        self.progress = ProgressRecords(
            self.runtime.dht, self.peer_id, settings.run_id, settings.outer_step_ttl
        )
        log.info(
            "hivemind swarm run_id=%s peer=%s: other peers join with backend.hivemind.initial_peers=%s",
            settings.run_id,
            self.peer_id,
            self.visible_maddrs,
        )
        for p, t in enumerate(self.timeouts):
            log.info(
                "hivemind fragment=%d sync_bytes=%d matchmaking_time=%.1f averaging_timeout=%.1f "
                "request_timeout=%.1f",
                p,
                t.sync_bytes,
                t.matchmaking_time,
                t.averaging_timeout,
                t.request_timeout,
            )

    # ---- a sync (exchange.py) -------------------------------------------------------------------------

    def start_average(self, fragment: int, tensors: list[torch.Tensor], step: int) -> AveragingHandle:
        """Start averaging `tensors` (fragment `fragment`, outer step `step`) with the peers present.

        Encodes now (the caller may reuse the tensors), the rest runs in the background. Every peer calls
        this once per fragment per outer step; a peer at another step is not averaged with. A tensor with
        non-finite values is not sent: this peer then only receives the others' mean.
        """
        return self._fragment(fragment).start(tensors, step)

    def start_average_encoded(self, fragment: int, payloads: list[bytes], step: int) -> AveragingHandle:
        """As start_average, for payloads already encoded with this swarm's compressors (e.g. by a
        PseudogradientCodec with error feedback: `muloco.sync.codec.unpack(codec.encode(delta, ef))`)."""
        return self._fragment(fragment).start_encoded(payloads, step)

    def _fragment(self, fragment: int) -> FragmentSync:
        if self._closed:
            raise RuntimeError("the hivemind swarm is closed")
        if not 0 <= fragment < len(self.shapes):
            raise ValueError(f"fragment {fragment} out of range: the swarm has {len(self.shapes)} fragments")
        if self.fragments[fragment].busy():
            raise RuntimeError(f"fragment {fragment}: wait() for the previous sync before starting the next")
        return self.fragments[fragment]

    # ---- joining (state_sharing.py), outer steps (progress.py) ----------------------------------------

    def share_state(self, get_state: Callable[[], tuple[list[torch.Tensor], dict]]) -> None:
        """Serve this peer's state to joiners from now on (see `state_sharing.share_state`)."""
        state_sharing.share_state(self.runtime.state_server, get_state)

    def load_state_from_peers(self, timeout: float) -> tuple[list[torch.Tensor], dict] | None:
        """A joiner's first act: (tensors, metadata) from a peer, or None (see state_sharing.py)."""
        return state_sharing.load_state_from_peers(self.runtime.state_server, timeout)

    def publish_outer_step(self, outer_step: int) -> None:
        """Record this peer's outer step in the DHT (expires after outer_step_ttl without a newer one)."""
        self.progress.publish(outer_step)

    def peer_outer_steps(self) -> dict[str, int]:
        """Peer id -> the outer step it published, for every live peer (this one included, once it
        published); empty if the DHT has none or cannot be read in time."""
        return self.progress.by_peer()

    def swarm_outer_step(self) -> int | None:
        """The highest outer step live peers published (this one's included), or None if none is known."""
        return self.progress.highest()

    # ---- shutdown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Serve what this peer's last groups still download, then stop everything (lifecycle.py).
        Idempotent; every step is time-bounded (a sync still in flight then ends as "no group")."""
        if self._closed:
            return
        self._closed = True
        self.payloads.serve_what_is_owed()
        self.runtime.close()

    def __enter__(self) -> HivemindSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
