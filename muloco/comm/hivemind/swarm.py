"""`HivemindSwarm`: one peer's membership of a hivemind swarm, put together from its parts.

lifecycle.py starts and stops what it runs on, exchange.py runs the syncs (its docstring walks through one),
transfer.py moves the payloads, state_sharing.py serves and loads the global state, progress.py keeps the
peers' outer steps in the DHT.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from hivemind.p2p import PeerID

from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.exchange import AveragingHandle, FragmentSync
from muloco.comm.hivemind.lifecycle import SwarmRuntime, require_fork_start_method
from muloco.comm.hivemind.payloads import _adapters
from muloco.comm.hivemind.progress import ProgressRecord, ProgressRecords
from muloco.comm.hivemind.settings import derive_timeouts, is_loopback
from muloco.comm.hivemind.state_sharing import StateServer, load_state, state_handler
from muloco.comm.hivemind.transfer import PayloadServer, handler_name
from muloco.compress import Compressor
from muloco.config import HivemindBackendConfig
from muloco.errors import ConfigError

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
        self.auth = SwarmAuth.from_settings(settings)  # ConfigError before anything starts
        self.payloads = PayloadServer(len(self.shapes), self.auth)
        self.runtime = SwarmRuntime()
        self._closed = False
        self.state_server: StateServer | None = None
        handlers = {
            handler_name(settings.run_id, p): partial(self.payloads.serve, p) for p in range(len(self.shapes))
        }
        handlers[state_handler(settings.run_id)] = self._serve_state
        try:
            self.runtime.start(settings, self.timeouts, handlers, self.auth)
            self.peer_id: PeerID = self.runtime.peer_id
            allowed = self.auth.allowed
            if allowed is not None and str(self.peer_id) not in allowed:
                raise ConfigError(
                    f"backend.hivemind.auth.allowed_peers does not list this peer's own id {self.peer_id} "
                    f"(from identity_path {settings.identity_path}); add it"
                )
        except BaseException:
            self.close()  # stops whatever had started: no orphan DHT, averager or p2p daemon
            raise
        self.state_server = StateServer(self.auth, self.peer_id)
        self.visible_maddrs: list[str] = self.runtime.visible_maddrs
        self.fragments = [
            FragmentSync(
                fragment=p,
                shapes=self.shapes[p],
                codecs=self.codecs[p],
                timeouts=self.timeouts[p],
                settings=settings,
                peer_id=self.peer_id,
                auth=self.auth,
                averager=self.runtime.averagers[p],
                payloads=self.payloads,
                runtime=self.runtime,
            )
            for p in range(len(self.shapes))
        ]
        self.progress = ProgressRecords(
            self.runtime.dht, self.peer_id, settings.run_id, settings.outer_step_ttl, self.auth
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

    def start_average(
        self,
        fragment: int,
        tensors: list[torch.Tensor],
        step: int,
        rule: tuple[str, int] = ("mean", 1),
        digest: bytes = b"",
        wait_s: float = 0.0,
        late: bool = False,
    ) -> AveragingHandle:
        """Start averaging `tensors` (fragment `fragment`, outer step `step`) with the peers present.

        Encodes now (the caller may reuse the tensors), the rest runs in the background. Every peer calls
        this once per fragment per outer step; a peer at another step is not averaged with. A tensor with
        non-finite values is not sent: this peer then only receives the others' mean. rule: (sync.aggregate,
        sync.trim), how the group's contributions are combined (muloco.comm.aggregate); every member must
        use the same. digest: this peer's state digest (`share_state`'s), announced to the group. wait_s:
        how long a group this peer leads may wait for more members before it begins (sync.deadline; 0:
        matchmaking_time), on top of which it looks for a group for the group deadline. late: a window
        that missed its own sync (sync.deadline): a group of late windows only is no group.
        """
        return self._fragment(fragment).start(tensors, step, rule, digest, wait_s, late)

    def start_average_encoded(
        self,
        fragment: int,
        payloads: list[bytes],
        step: int,
        rule: tuple[str, int] = ("mean", 1),
        digest: bytes = b"",
        wait_s: float = 0.0,
        late: bool = False,
    ) -> AveragingHandle:
        """As start_average, for payloads already encoded with this swarm's compressors (e.g. by a
        PseudogradientCodec with error feedback: `muloco.sync.codec.unpack(codec.encode(delta, ef))`)."""
        return self._fragment(fragment).start_encoded(payloads, step, rule, digest, wait_s, late)

    def _fragment(self, fragment: int) -> FragmentSync:
        if self._closed:
            raise RuntimeError("the hivemind swarm is closed")
        if not 0 <= fragment < len(self.shapes):
            raise ValueError(f"fragment {fragment} out of range: the swarm has {len(self.shapes)} fragments")
        if self.fragments[fragment].busy():
            raise RuntimeError(f"fragment {fragment}: wait() for the previous sync before starting the next")
        return self.fragments[fragment]

    # ---- joining (state_sharing.py), outer steps (progress.py) ----------------------------------------

    def share_state(self, tensors: list[torch.Tensor], meta: dict[str, int]) -> bytes:
        """Serve copies of this state (global parameters + outer momentum, and the counters step,
        outer_steps, fragment_syncs) to authenticated peers from now on; returns its digest."""
        return self.state_server.offer(tensors, meta)

    async def _serve_state(self, request, context):
        if self.state_server is not None:  # None only while the swarm starts
            async for reply in self.state_server.serve(request, context):
                yield reply

    def load_state_from_peers(
        self,
        like: list[torch.Tensor],
        timeout: float,
        donors: list[PeerID] | None = None,
        min_progress: int = 0,
        digests: set[bytes] | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, int], PeerID] | None:
        """(tensors, counters, donor) from the first donor whose state checks out (state_sharing.py), or
        None. donors: by default the peers with progress records, furthest ahead first. like: this peer's
        own state tensors (the shapes to expect); min_progress, digests: which states qualify."""
        if donors is None:
            records = self.progress.records()
            ahead = sorted(records, key=lambda p: (-records[p].progress, p.to_bytes()))
            donors = [p for p in ahead if p != self.peer_id]
        if not donors:
            log.info("hivemind: no peer to load the state from (a new swarm?)")
            return None
        name = state_handler(self.settings.run_id)
        loop, p2p = self.runtime.loop, self.runtime.p2p
        return load_state(
            loop, p2p, name, self.auth, self.peer_id, donors, like, timeout, min_progress, digests
        )

    def publish_outer_step(self, outer_step: int, digest: bytes = b"") -> None:
        """Record this peer's progress and state digest in the DHT (expires after outer_step_ttl)."""
        self.progress.publish(outer_step, digest)

    def peer_records(self) -> dict[PeerID, ProgressRecord]:
        """Every live peer's authenticated progress record (progress.py)."""
        return self.progress.records()

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
