"""What a swarm runs on, started and stopped: hivemind's DHT and one averager per fragment (forked
processes), hivemind's P2P with this peer's payload and state handlers, an asyncio loop thread and the sync
executor."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from muloco.comm.hivemind import matchmaking
from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.combine import unauthenticated_metadata
from muloco.comm.hivemind.progress import SwarmRecordValidator
from muloco.comm.hivemind.settings import DHT_OP_TIMEOUT_S, SyncTimeouts
from muloco.config import HivemindBackendConfig
from muloco.errors import ConfigError

log = logging.getLogger("muloco")


def require_fork_start_method() -> None:
    """hivemind's DHT and averagers are forked processes that receive pipes through pipes; under the spawn
    or forkserver start method (the default inside a spawned process, and from Python 3.14) they fail
    with EOFError / pickling errors. Sets "fork" if no start method was chosen yet, else raises."""
    if multiprocessing.get_start_method(allow_none=True) is None:
        multiprocessing.set_start_method("fork")
    method = multiprocessing.get_start_method()
    if method != "fork":
        raise RuntimeError(
            f"the hivemind backend needs the 'fork' multiprocessing start method, this process uses "
            f"{method!r}: call multiprocessing.set_start_method('fork', force=True) before building the swarm"
        )


class _EventLoopThread:
    """An asyncio loop in a daemon thread: hivemind's P2P is async, the swarm's callers are not."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="muloco-hivemind-p2p", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def stop(self, timeout: float = 5.0) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()


class SwarmRuntime:
    """The processes and threads behind one peer's swarm membership.

    `start` may fail part-way (a bad multiaddr, an unreachable initial peer); `close` then stops whatever
    had started, so that no DHT, averager or p2p daemon is left orphaned."""

    def __init__(self) -> None:
        self.dht: hivemind.DHT | None = None
        self.averagers: list[DecentralizedAverager] = []  # one per fragment: matchmaking + metadata
        self.loop: _EventLoopThread | None = None
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None  # runs the syncs
        self.p2p = None  # this process's replica of the DHT's P2P daemon: payload streams
        self.peer_id: PeerID | None = None
        self.visible_maddrs: list[str] = []
        self._handler_names: list[str] = []

    def start(
        self,
        settings: HivemindBackendConfig,
        timeouts: list[SyncTimeouts],
        handlers: dict[str, Callable],
        auth: SwarmAuth,
    ) -> None:
        """Start everything; timeouts[p] is fragment p's, handlers map a P2P handler name to its (async,
        streaming) function. Call from the main thread (hivemind installs signal handlers)."""
        # Processes first (hivemind forks them), threads after: forking a process with threads is unsafe.
        self.dht = _start_dht(settings, auth)
        self.peer_id = self.dht.peer_id
        # hivemind's averager sets SIGINT to "ignore" in *this* process before it forks (so that its child
        # ignores Ctrl-C); put the caller's handler back so that Ctrl-C still interrupts training.
        sigint = signal.getsignal(signal.SIGINT)
        try:
            for p, t in enumerate(timeouts):
                self.averagers.append(_start_averager(self.dht, settings, p, t, auth))
        finally:
            signal.signal(signal.SIGINT, sigint)
        self.loop = _EventLoopThread()
        self.executor = concurrent.futures.ThreadPoolExecutor(len(timeouts), "muloco-hivemind-sync")
        self._handler_names = list(handlers)
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout=DHT_OP_TIMEOUT_S)
        for name, handler in handlers.items():
            self.loop.run(
                self.p2p.add_protobuf_handler(name, handler, averaging_pb2.DownloadData, stream_output=True),
                timeout=DHT_OP_TIMEOUT_S,
            )
        self.visible_maddrs = [str(m) for m in self.dht.get_visible_maddrs()]

    def close(self) -> None:
        """Stop the syncs, the P2P replica and the loop, then the averagers and the DHT. Every step is
        time-bounded (a sync still in flight then ends as "no group"). Call once."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.loop is not None:
            try:
                if self.p2p is not None:
                    for name in self._handler_names:
                        self.loop.run(self.p2p.remove_protobuf_handler(name, stream_output=True), 5)
                    self.loop.run(self.p2p.shutdown(), 5)
            except Exception as exc:  # the daemon may already be gone
                log.debug("hivemind: P2P replica shutdown: %s", exc)
            self.loop.stop()
        for averager in self.averagers:
            if averager.is_alive():
                averager.shutdown()  # joins for shutdown_timeout, then terminates
        if self.dht is not None:
            self.dht.shutdown()  # joins for its shutdown_timeout, then terminates


def _start_dht(s: HivemindBackendConfig, auth: SwarmAuth) -> hivemind.DHT:
    try:
        return hivemind.DHT(
            record_validators=[SwarmRecordValidator(auth, s.run_id, s.outer_step_ttl)],
            initial_peers=s.initial_peers,
            start=True,
            host_maddrs=s.host_maddrs,
            announce_maddrs=s.announce_maddrs or None,
            use_relay=s.use_relay,
            use_auto_relay=s.use_auto_relay,
            identity_path=s.identity_path,
        )
    except Exception as exc:  # bad multiaddr, unreachable initial peers, taken identity: say which field
        raise ConfigError(
            f"backend.hivemind: could not start the DHT ({exc}); check initial_peers {s.initial_peers}, "
            f"host_maddrs {s.host_maddrs} and identity_path {s.identity_path!r}"
        ) from exc


def _start_averager(
    dht: hivemind.DHT, s: HivemindBackendConfig, fragment: int, t: SyncTimeouts, auth: SwarmAuth
) -> DecentralizedAverager:
    averager = DecentralizedAverager(
        [torch.zeros(1)],  # a dummy: the averager only forms groups and gathers metadata
        dht,
        start=False,
        prefix=f"{s.run_id}_fragment{fragment}",
        min_matchmaking_time=t.matchmaking_time,
        request_timeout=t.request_timeout,
        allreduce_timeout=2 * t.request_timeout,
        next_chunk_timeout=t.request_timeout,
        min_group_size=s.min_group_size,
        target_group_size=s.target_group_size,
        allow_state_sharing=False,
        shutdown_timeout=2,
    )
    if auth.enabled or auth.allowed is not None:
        matchmaking.install()

        def admit(peer, data_for_gather: bytes) -> bool:
            meta = matchmaking.user_metadata(data_for_gather)
            return unauthenticated_metadata(auth, fragment, peer, meta) is None

        averager.matchmaking_kwargs["admit"] = admit
    averager.run_in_background(await_ready=True)
    return averager
