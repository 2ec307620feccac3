"""The hivemind backend: peers on the internet form a swarm (a DHT) and average pseudogradients in groups.

One sync of fragment p (`HivemindSwarm.start_average`, then `AveragingHandle.wait`), the same on every peer:

1. encode   our compressors (muloco.compress) turn each tensor into a payload; the peer serves its payloads
            over hivemind's P2P under a token (a hash of the payloads), for the current and the previous sync.
2. match    hivemind's DecentralizedAverager (DHT prefix f"{run_id}_fragment{p}") forms a group of the peers
            looking within matchmaking_time and all-gathers each member's small metadata (step, token). Its
            all-reduce runs on a 1-element dummy tensor only.
3. exchange every member downloads every other member's payloads from that member, within averaging_timeout
            (a mesh all-gather: each peer uploads its payloads G - 1 times, as in a ring all-gather).
4. combine  every member decodes and checks every payload and drops bad ones by one rule, applied to the same
            bytes on every member; it averages the rest in peer-id order, so the members hold the same mean,
            bit for bit (also with 4-bit compression), and the mean is that of the decoded contributions.

Why not hivemind's all-reduce with our compressors behind its CompressionBase (hivemind 1.1.12):
- a receiver deserializes by protobuf enum through a fixed table (hivemind.compression.serialization), so a
  custom CompressionBase runs on the sender only; the receiver would need a patched hivemind module global;
- the all-reduce cuts tensors into flat parts: row-wise quantization statistics are lost;
- each reducer re-compresses "mean - own part" for the way back and each peer adds it to its *uncompressed*
  tensor: with 4-bit compression every peer ends with a different mean and DiLoCo's global parameters drift;
- averaging happens inside the protocol: a NaN contribution poisons the sum (NaN x weight 0 is NaN) and no
  receiver can drop a contribution whose norm is far above the others'.
Payloads still travel in hivemind's tensor message, through `MulocoCompression` (a CompressionBase adapter).

Joining: `share_state` serves the global state with hivemind's state sharing (a dedicated averager, prefix
f"{run_id}_state"); a joiner calls `load_state_from_peers` first. `publish_outer_step` / `swarm_outer_step`
keep the outer steps in the DHT so that a slow peer sees it is behind.

Leaving: a peer that dies before matchmaking is simply absent; one that dies in the dummy all-reduce makes
the group retry matchmaking until the group deadline; one that dies during the exchange is dropped when its
download fails (at most averaging_timeout). Caveat: if it dies while its payload is half downloaded, members
that got it include it and the others do not: their means differ for that sync (hivemind's own all-reduce
has the same weakness).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from muloco.comm.hivemind.combine import (
    _metadata_problem,
    contribution_norm,
    contribution_problem,
    mean_in_order,
    norm_outliers,
)
from muloco.comm.hivemind.payloads import _adapters, payload_token, wrap_payload
from muloco.comm.hivemind.settings import (
    DHT_OP_TIMEOUT_S,
    HANDLE_SLACK_S,
    HivemindSettings,
    SyncTimeouts,
    _is_int,
    derive_timeouts,
    is_loopback,
)
from muloco.compress import CompressionError, Compressor
from muloco.errors import ConfigError

log = logging.getLogger("muloco")

CHUNK_BYTES = 1 << 20  # payload stream chunks (hivemind's stream messages have no size limit)
SERVED_SYNCS = 2  # payloads kept per fragment: a fast peer may start its next sync while others download
# A download counts as served once the handler has handed its last chunk to the p2p daemon, before the peer
# has it: close() waits this much longer before shutting the daemon down.
DELIVERY_GRACE_S = 0.5


# ---- results and handles --------------------------------------------------------------------------------


@dataclass
class AverageResult:
    """The outcome of one sync of one fragment."""

    mean: list[torch.Tensor] | None  # fp32 CPU tensors; None: nothing to apply (see averaged)
    group_size: int  # peers in the group, this one included (1: no group)
    excluded: int  # group members whose contribution was dropped (excluded_reasons says why)
    averaged: bool  # False: no usable group; mean = own decoded contribution (apply_own) or None (skip)
    excluded_reasons: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    seconds: dict[str, float] = field(default_factory=dict)  # encode, matchmaking, exchange, combine

    @property
    def contributors(self) -> int:
        return self.group_size - self.excluded if self.averaged else int(self.mean is not None)


class AveragingHandle:
    """A sync in flight. `wait()` blocks at most until the sync's worst case (+ slack), then returns the
    no-group outcome rather than hang."""

    def __init__(
        self, future: concurrent.futures.Future, fallback: Callable[[], AverageResult], bound_s: float
    ) -> None:
        self._future, self._fallback = future, fallback
        self._deadline = time.monotonic() + bound_s
        self._result: AverageResult | None = None

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> AverageResult:
        if self._result is None:
            try:
                self._result = self._future.result(timeout=max(0.0, self._deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                log.error("hivemind sync did not finish within its worst case: treated as no group")
                self._result = self._fallback()
        return self._result


@dataclass
class _Contribution:
    """This peer's side of a sync: what it serves, and what the group will decode from it."""

    step: int
    messages: list[runtime_pb2.Tensor] | None  # None: withheld (see problem)
    decoded: list[torch.Tensor] | None
    problem: str | None  # why this peer sends nothing (e.g. non-finite values)
    token: bytes = b""


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


class _StateServer(DecentralizedAverager):
    """Serves this peer's global state to joiners through hivemind's state sharing; never averages."""

    get_state: Callable[[], tuple[list[torch.Tensor], dict]] | None = None

    def get_current_state(self):
        # Runs in this (host) process, in hivemind's background thread, when a joiner asks.
        assert self.get_state is not None, "state sharing is on without a get_state callback"
        tensors, meta = self.get_state()
        return {"muloco_state": meta}, [t.detach().cpu() for t in tensors], None


# ---- the swarm ------------------------------------------------------------------------------------------


class HivemindSwarm:
    """This peer's membership of a hivemind swarm: one averager per fragment, state sharing, outer steps.

    Build it in the main thread (hivemind installs signal handlers), with the fork start method.
    tensor_shapes_by_fragment[p] lists the shapes of fragment p's tensors (plain DiLoCo: one fragment).
    compression: None (fp32, bit-exact), one Compressor for every tensor, or one per tensor
    (list per fragment, e.g. a PseudogradientCodec's compressors). Every peer must use the same.
    """

    def __init__(
        self,
        settings: HivemindSettings,
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
        self._lock = threading.Lock()
        self._served: list[OrderedDict[bytes, list[runtime_pb2.Tensor]]] = [
            OrderedDict() for _ in self.shapes
        ]
        self._pending: list[concurrent.futures.Future | None] = [None] * len(self.shapes)
        # Downloads of this peer's payloads that its last groups still owe: token -> [left, deadline].
        # close() serves them before it stops, so a run's last sync is not cut off for slower members.
        self._owed: dict[bytes, list[float]] = {}
        self.dht: hivemind.DHT | None = None
        self._averagers: list[DecentralizedAverager] = []
        self._state_server: _StateServer | None = None
        self._loop: _EventLoopThread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._p2p = None
        self._closed = False
        try:
            self._start_swarm()
        except BaseException:
            self.close()  # stops whatever had started: no orphan DHT, averager or p2p daemon
            raise
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

    # ---- start-up -------------------------------------------------------------------------------------

    def _start_swarm(self) -> None:
        # Processes first (hivemind forks them), threads after: forking a process with threads is unsafe.
        self.dht = self._start_dht()
        self.peer_id: PeerID = self.dht.peer_id
        # hivemind's averager sets SIGINT to "ignore" in *this* process before it forks (so that its child
        # ignores Ctrl-C); put the caller's handler back so that Ctrl-C still interrupts training.
        sigint = signal.getsignal(signal.SIGINT)
        try:
            for p, t in enumerate(self.timeouts):
                self._averagers.append(self._start_averager(p, t))
            self._state_server = _StateServer(
                [torch.zeros(1)],
                self.dht,
                start=True,
                prefix=f"{self.settings.run_id}_state",
                min_matchmaking_time=self.timeouts[0].matchmaking_time,
                request_timeout=self.timeouts[0].request_timeout,
                allow_state_sharing=False,
                shutdown_timeout=2,
            )
        finally:
            signal.signal(signal.SIGINT, sigint)
        self._loop = _EventLoopThread()
        self._executor = concurrent.futures.ThreadPoolExecutor(len(self.shapes), "muloco-hivemind-sync")
        self._p2p = self._loop.run(self.dht.replicate_p2p(), timeout=DHT_OP_TIMEOUT_S)
        for p in range(len(self.shapes)):
            handler = partial(self._serve_payloads, p)
            self._loop.run(
                self._p2p.add_protobuf_handler(
                    self._handler_name(p), handler, averaging_pb2.DownloadData, stream_output=True
                ),
                timeout=DHT_OP_TIMEOUT_S,
            )
        self.visible_maddrs = [str(m) for m in self.dht.get_visible_maddrs()]

    def _start_dht(self) -> hivemind.DHT:
        s = self.settings
        try:
            return hivemind.DHT(
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

    def _start_averager(self, fragment: int, t: SyncTimeouts) -> DecentralizedAverager:
        return DecentralizedAverager(
            [torch.zeros(1)],  # a dummy: the averager only forms groups and gathers metadata
            self.dht,
            start=True,
            prefix=f"{self.settings.run_id}_fragment{fragment}",
            min_matchmaking_time=t.matchmaking_time,
            request_timeout=t.request_timeout,
            allreduce_timeout=2 * t.request_timeout,
            next_chunk_timeout=t.request_timeout,
            min_group_size=self.settings.min_group_size,
            target_group_size=self.settings.target_group_size,
            allow_state_sharing=False,
            shutdown_timeout=2,
        )

    def _handler_name(self, fragment: int) -> str:
        return f"muloco_{self.settings.run_id}_fragment{fragment}_payloads"

    # ---- a sync ---------------------------------------------------------------------------------------

    def start_average(self, fragment: int, tensors: list[torch.Tensor], step: int) -> AveragingHandle:
        """Start averaging `tensors` (fragment `fragment`, outer step `step`) with the peers present.

        Encodes now (the caller may reuse the tensors), the rest runs in the background. Every peer calls
        this once per fragment per outer step; a peer at another step is not averaged with. A tensor with
        non-finite values is not sent: this peer then only receives the others' mean.
        """
        self._check_fragment(fragment)
        shapes = self.shapes[fragment]
        if len(tensors) != len(shapes) or any(t.shape != s for t, s in zip(tensors, shapes, strict=False)):
            raise ValueError(
                f"fragment {fragment}: got shapes {[tuple(t.shape) for t in tensors]}, the swarm was built "
                f"for {[tuple(s) for s in shapes]}"
            )
        t0 = time.perf_counter()
        try:
            messages = [codec.compress(t) for codec, t in zip(self.codecs[fragment], tensors, strict=True)]
        except CompressionError as exc:
            own = _Contribution(int(step), None, None, f"withheld by its peer: {exc}")
        else:
            own = self._own_contribution(fragment, int(step), messages)
        return self._launch(fragment, own, time.perf_counter() - t0)

    def start_average_encoded(self, fragment: int, payloads: list[bytes], step: int) -> AveragingHandle:
        """As start_average, for payloads already encoded with this swarm's compressors (e.g. by a
        PseudogradientCodec with error feedback: `muloco.codec.unpack(codec.encode(delta, ef))`)."""
        self._check_fragment(fragment)
        own = self._own_contribution(fragment, int(step), [wrap_payload(p) for p in payloads])
        return self._launch(fragment, own, 0.0)

    def _check_fragment(self, fragment: int) -> None:
        if self._closed:
            raise RuntimeError("the hivemind swarm is closed")
        if not 0 <= fragment < len(self.shapes):
            raise ValueError(f"fragment {fragment} out of range: the swarm has {len(self.shapes)} fragments")
        pending = self._pending[fragment]
        if pending is not None and not pending.done():
            raise RuntimeError(f"fragment {fragment}: wait() for the previous sync before starting the next")

    def _own_contribution(
        self, fragment: int, step: int, messages: list[runtime_pb2.Tensor]
    ) -> _Contribution:
        """Decode our own payloads exactly as the group will, so the mean uses the same bytes everywhere."""
        try:
            decoded = self._decode(fragment, messages)
        except CompressionError as exc:
            return _Contribution(step, None, None, f"withheld by its peer: {exc}")
        problem = contribution_problem(decoded, self.shapes[fragment])
        if problem is not None:
            return _Contribution(step, None, None, f"withheld by its peer: {problem}")
        return _Contribution(step, messages, decoded, None, payload_token(messages))

    def _launch(self, fragment: int, own: _Contribution, encode_s: float) -> AveragingHandle:
        if own.messages is not None:
            with self._lock:  # served until SERVED_SYNCS newer syncs of this fragment replace it
                served = self._served[fragment]
                served[own.token] = own.messages
                while len(served) > SERVED_SYNCS:
                    served.popitem(last=False)
        else:
            log.warning("hivemind fragment=%d step=%d sends nothing: %s", fragment, own.step, own.problem)
        future = self._executor.submit(self._sync, fragment, own, encode_s)
        self._pending[fragment] = future
        t = self.timeouts[fragment]
        return AveragingHandle(
            future, partial(self._no_group, own, {"encode": encode_s}), t.worst_case + HANDLE_SLACK_S
        )

    def _sync(self, fragment: int, own: _Contribution, encode_s: float) -> AverageResult:
        """Matchmaking, exchange, combine (runs in the executor). Every member applies the same rule to
        the same bytes, so members that downloaded the same payloads hold the same mean, bit for bit."""
        seconds = {"encode": encode_s}
        t0 = time.perf_counter()
        members = self._find_group(fragment, own)
        seconds["matchmaking"] = time.perf_counter() - t0
        if members is None:
            return self._no_group(own, seconds)

        if own.messages is not None:
            with self._lock:
                now = time.monotonic()
                self._owed = {k: v for k, v in self._owed.items() if v[0] > 0 and v[1] > now}
                self._owed[own.token] = [len(members) - 1, now + self.timeouts[fragment].averaging_timeout]
        t1 = time.perf_counter()
        tokens, reasons = self._tokens_to_fetch(own, members)
        downloads = self._download_all(fragment, tokens)
        seconds["exchange"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        contributions = self._contributions(fragment, own, tokens, downloads, reasons)
        norms = {str(peer): contribution_norm(t) for peer, t in contributions.items()}
        reasons.update(norm_outliers(norms, self.settings.max_norm_ratio))
        used = sorted((p for p in contributions if str(p) not in reasons), key=lambda p: p.to_bytes())
        for peer, why in reasons.items():
            log.warning(
                "hivemind excluded peer=%s fragment=%d step=%d reason=%s", peer, fragment, own.step, why
            )
        mean = (
            mean_in_order([contributions[p] for p in used]) if any(p != self.peer_id for p in used) else None
        )
        seconds["combine"] = time.perf_counter() - t2
        if mean is None or contribution_problem(mean, self.shapes[fragment]) is not None:
            # Nobody else's contribution is usable, or finite inputs overflowed: as if there were no group.
            result = self._no_group(own, seconds, own_excluded=str(self.peer_id) in reasons)
            result.group_size, result.excluded, result.excluded_reasons = len(members), len(reasons), reasons
            return result
        log.info(
            "hivemind sync fragment=%d step=%d group=%d used=%d excluded=%d matchmaking_s=%.2f "
            "exchange_s=%.2f combine_s=%.2f",
            *(fragment, own.step, len(members), len(used), len(reasons)),
            *(seconds["matchmaking"], seconds["exchange"], seconds["combine"]),
        )
        return AverageResult(mean, len(members), len(reasons), True, reasons, seconds)

    def _tokens_to_fetch(
        self, own: _Contribution, members: dict[PeerID, dict]
    ) -> tuple[dict[PeerID, bytes], dict[str, str]]:
        """The other members' payload tokens; a member at another outer step or with malformed metadata
        is excluded without a download."""
        tokens, reasons = {}, {}
        for peer, meta in members.items():
            if peer == self.peer_id:
                continue
            problem = _metadata_problem(meta, own.step)
            if problem is None:
                tokens[peer] = meta["token"]
            else:
                reasons[str(peer)] = problem
        return tokens, reasons

    def _contributions(
        self,
        fragment: int,
        own: _Contribution,
        tokens: dict[PeerID, bytes],
        downloads: dict[PeerID, list[runtime_pb2.Tensor] | str],
        reasons: dict[str, str],
    ) -> dict[PeerID, list[torch.Tensor]]:
        """Decode and check every contribution, own included; record why each bad one is excluded."""
        checked = {self.peer_id: own.problem if own.decoded is None else self._checked(fragment, own.decoded)}
        for peer, token in tokens.items():
            checked[peer] = self._checked_download(fragment, downloads[peer], token)
        for peer, result in checked.items():
            if isinstance(result, str):
                reasons[str(peer)] = result
        return {peer: result for peer, result in checked.items() if not isinstance(result, str)}

    def _find_group(self, fragment: int, own: _Contribution) -> dict[PeerID, dict] | None:
        """hivemind matchmaking: the group's members and their metadata, or None (no group in time).

        Blocks up to the group deadline; hivemind retries matchmaking (and a failed dummy all-reduce) until
        then. A peer that finds nobody in time gets None here and applies on_no_group."""
        t = self.timeouts[fragment]
        averager = self._averagers[fragment]
        if not averager.is_alive():
            log.error("hivemind averager of fragment %d is not running: no group", fragment)
            return None
        meta = {"step": own.step, "token": own.token if own.messages is not None else None}
        control = None
        try:
            control = averager.step(gather=meta, timeout=t.group_deadline, allow_retries=True, wait=False)
            gathered = control.result(timeout=t.group_deadline + t.averaging_timeout)
        except Exception as exc:  # MatchmakingException, AllreduceException, TimeoutError, a closed pipe
            log.info("hivemind fragment=%d step=%d: no group (%s)", fragment, own.step, type(exc).__name__)
            if control is not None and not control.done():
                control.cancel()  # frees the averager for the next sync
            return None
        if not isinstance(gathered, dict) or len(gathered) < 2:
            return None
        return gathered

    def _no_group(self, own: _Contribution, seconds: dict, own_excluded: bool = False) -> AverageResult:
        apply_own = self.settings.on_no_group == "apply_own" and own.decoded is not None and not own_excluded
        mean = [t.clone() for t in own.decoded] if apply_own else None
        log.info("hivemind step=%d: no group, %s", own.step, "applying own" if apply_own else "skipping")
        return AverageResult(mean, 1, 0, False, {}, dict(seconds))

    # ---- payload exchange -----------------------------------------------------------------------------

    async def _serve_payloads(
        self, fragment: int, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """P2P handler: stream the payloads whose token the requester names (request.metadata)."""
        with self._lock:
            messages = self._served[fragment].get(bytes(request.metadata))
        if messages is None:
            return  # an empty stream: the requester records "payload unavailable"
        for message in messages:
            for part in split_for_streaming(message, CHUNK_BYTES):
                yield averaging_pb2.DownloadData(tensor_part=part)
        with self._lock:
            owed = self._owed.get(bytes(request.metadata))
            if owed is not None:
                owed[0] -= 1

    async def _download(self, fragment: int, peer: PeerID, token: bytes) -> list[runtime_pb2.Tensor]:
        """One member's payloads; a stream larger than this fragment's payloads is cut off (a bad peer)."""
        limit = self.timeouts[fragment].sync_bytes + 64 * 1024
        stream = await self._p2p.iterate_protobuf_handler(
            peer,
            self._handler_name(fragment),
            averaging_pb2.DownloadData(metadata=token),
            averaging_pb2.DownloadData,
        )
        messages, parts, received = [], [], 0
        async for reply in stream:
            part = reply.tensor_part
            received += len(part.buffer)
            if received > limit:
                raise CompressionError(f"sent more than the {limit} bytes this fragment's payloads take")
            if part.dtype and parts:  # a set dtype starts the next tensor (hivemind's streaming convention)
                messages.append(combine_from_streaming(parts))
                parts = []
            parts.append(part)
        if parts:
            messages.append(combine_from_streaming(parts))
        return messages

    def _download_all(
        self, fragment: int, tokens: dict[PeerID, bytes]
    ) -> dict[PeerID, list[runtime_pb2.Tensor] | str]:
        """Every member's payloads, concurrently, each within averaging_timeout; failures as reasons."""
        timeout = self.timeouts[fragment].averaging_timeout

        async def one(peer: PeerID, token: bytes):
            try:
                return await asyncio.wait_for(self._download(fragment, peer, token), timeout)
            except asyncio.TimeoutError:
                return f"download timed out after {timeout:.1f} s"
            except Exception as exc:  # the peer left, refused, or streamed garbage
                return f"download failed: {type(exc).__name__}: {exc}"

        async def all_of_them():
            results = await asyncio.gather(*(one(p, t) for p, t in tokens.items()))
            return dict(zip(tokens, results, strict=True))

        if not tokens:
            return {}
        try:
            return self._loop.run(all_of_them(), timeout=timeout + HANDLE_SLACK_S)
        except (concurrent.futures.TimeoutError, RuntimeError):  # RuntimeError: the swarm was closed
            return {p: "download did not finish" for p in tokens}

    def _decode(self, fragment: int, messages: list[runtime_pb2.Tensor]) -> list[torch.Tensor]:
        if len(messages) != len(self.codecs[fragment]):
            raise CompressionError(f"{len(messages)} payloads, expected {len(self.codecs[fragment])}")
        return [codec.extract(m) for codec, m in zip(self.codecs[fragment], messages, strict=True)]

    def _checked(self, fragment: int, decoded: list[torch.Tensor]) -> list[torch.Tensor] | str:
        return contribution_problem(decoded, self.shapes[fragment]) or decoded

    def _checked_download(self, fragment: int, got: list[runtime_pb2.Tensor] | str, token: bytes):
        """A member's decoded, checked contribution, or why it is excluded."""
        if isinstance(got, str):
            return got  # the download failed
        if not got:
            return "payload unavailable (the peer left, or no longer serves it)"
        if payload_token(got) != token:
            return "payloads do not match the token the peer announced"
        try:
            decoded = self._decode(fragment, got)
        except CompressionError as exc:
            return f"undecodable: {exc}"
        return self._checked(fragment, decoded)

    # ---- joining, outer steps -------------------------------------------------------------------------

    def share_state(self, get_state: Callable[[], tuple[list[torch.Tensor], dict]]) -> None:
        """Serve this peer's state to joiners from now on: get_state() -> (tensors, metadata), called when
        a joiner asks (e.g. global parameters + outer momentum, {"outer_step": 12}), from a hivemind
        background thread: return tensors that the training loop does not modify meanwhile (copies taken
        at the last outer step). The metadata must be msgpack-serializable (numbers, strings, bytes, lists,
        dicts); it is checked once here."""
        tensors, meta = get_state()
        if not isinstance(meta, dict) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError("get_state must return (list of tensors, dict)")
        MSGPackSerializer.dumps(meta)  # raises now rather than in hivemind's thread when a joiner asks
        self._state_server.get_state = get_state
        self._state_server.allow_state_sharing = True

    def load_state_from_peers(self, timeout: float) -> tuple[list[torch.Tensor], dict] | None:
        """A joiner's first act: download (tensors, metadata) from a peer that shares its state (hivemind
        tries donors in priority order). None if there is none, it fails, or it sends non-finite tensors."""
        try:
            got = self._state_server.load_state_from_peers(wait=True, timeout=timeout)
        except Exception as exc:  # TimeoutError, P2P errors
            log.warning("hivemind: could not load state from peers: %s: %s", type(exc).__name__, exc)
            return None
        if got is None:
            log.info("hivemind: no peer shares its state (a new swarm?)")
            return None
        meta, tensors = got
        if not isinstance(meta, dict) or not isinstance(meta.get("muloco_state"), dict):
            log.warning("hivemind: a peer sent state without muloco metadata: ignored")
            return None
        for i, t in enumerate(tensors):
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                log.warning("hivemind: state tensor %d from a peer is not finite floats: ignored", i)
                return None
        return list(tensors), meta["muloco_state"]

    def _outer_step_key(self) -> str:
        return f"{self.settings.run_id}_outer_step"

    def publish_outer_step(self, outer_step: int) -> None:
        """Record this peer's outer step in the DHT (expires after outer_step_ttl without a newer one)."""
        expiration = get_dht_time() + self.settings.outer_step_ttl
        future = self.dht.store(
            self._outer_step_key(),
            int(outer_step),
            expiration,
            subkey=self.peer_id.to_bytes(),
            return_future=True,
        )
        try:
            future.result(timeout=DHT_OP_TIMEOUT_S)
        except Exception as exc:
            log.warning("hivemind: could not publish outer_step=%d: %s", outer_step, exc)

    def peer_outer_steps(self) -> dict[str, int]:
        """Peer id -> the outer step it published, for every live peer (this one included, once it
        published); empty if the DHT has none or cannot be read in time."""
        future = self.dht.get(self._outer_step_key(), latest=True, return_future=True)
        try:
            found = future.result(timeout=DHT_OP_TIMEOUT_S)
        except Exception as exc:
            log.warning("hivemind: could not read the swarm's outer steps: %s", exc)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        return {
            str(PeerID(subkey)): v.value
            for subkey, v in found.value.items()
            if isinstance(subkey, bytes)
            and isinstance(v, ValueWithExpiration)
            and _is_int(v.value)
            and v.expiration_time > now
        }

    def swarm_outer_step(self) -> int | None:
        """The highest outer step live peers published (this one's included), or None if none is known."""
        return max(self.peer_outer_steps().values(), default=None)

    # ---- shutdown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving, shut the averagers and the DHT down. Idempotent; every step is time-bounded
        (a sync still in flight then ends as "no group")."""
        if self._closed:
            return
        self._closed = True
        self._serve_what_is_owed()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            try:
                if self._p2p is not None:
                    for p in range(len(self.shapes)):
                        name = self._handler_name(p)
                        self._loop.run(self._p2p.remove_protobuf_handler(name, stream_output=True), 5)
                    self._loop.run(self._p2p.shutdown(), 5)
            except Exception as exc:  # the daemon may already be gone
                log.debug("hivemind: P2P replica shutdown: %s", exc)
            self._loop.stop()
        for averager in [*self._averagers, self._state_server]:
            if averager is not None and averager.is_alive():
                averager.shutdown()  # joins for shutdown_timeout, then terminates
        if self.dht is not None:
            self.dht.shutdown()  # joins for its shutdown_timeout, then terminates

    def _serve_what_is_owed(self) -> None:
        """Keep serving until every member of this peer's recent groups has downloaded its payloads, or
        their averaging_timeout has passed: a fast peer ending its run must not cut the last sync's
        downloads of slower members short (over a slow link they take seconds)."""
        started = time.monotonic()
        with self._lock:
            recent = any(deadline > started for _, deadline in self._owed.values())
        while True:
            with self._lock:
                waiting = [d for left, d in self._owed.values() if left > 0 and d > time.monotonic()]
            if not waiting:
                break
            time.sleep(0.05)
        if recent:
            time.sleep(DELIVERY_GRACE_S)
        if time.monotonic() - started > 0.1:
            log.info(
                "hivemind: served the last sync's payloads for %.1f s before leaving",
                time.monotonic() - started,
            )

    def __enter__(self) -> HivemindSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
