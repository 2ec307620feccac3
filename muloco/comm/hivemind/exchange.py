"""One sync of the hivemind backend: peers on the internet form a swarm (a DHT) and average pseudogradients
in groups.

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

Joining: `share_state` serves the global state over P2P to authenticated peers; a joiner calls
`load_state_from_peers` first (state_sharing.py). `publish_outer_step` keeps each peer's progress and state
digest in the DHT so that a slow peer sees it is behind and a joiner finds donors (progress.py).

Membership (auth.py): with backend.hivemind.auth every metadata, payload request, state and progress record
carries an HMAC tag; a member without the key is excluded from the group's combine on every member alike.

Consistency: each member announces its state digest in its metadata; all members see the same metadata,
so a member whose digest differs from the group's majority knows it, and loads the state of the majority's
lowest peer id after the sync (sync/swarm.py).

Leaving: a peer that dies before matchmaking is simply absent; one that dies in the dummy all-reduce makes
the group retry matchmaking until the group deadline; one that dies during the exchange is dropped when its
download fails (at most averaging_timeout). If it dies while its payload is half downloaded, members that
got it include it and the others do not: their means differ for that sync (hivemind's own all-reduce has
the same weakness); the digests of the next sync show it and the members realign (see Consistency).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.timed_storage import get_dht_time

from muloco.comm.aggregate import aggregate, robust_minimum
from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.combine import (
    _metadata_problem,
    contribution_norm,
    contribution_problem,
    norm_outliers,
    unauthenticated_metadata,
    withheld,
)
from muloco.comm.hivemind.exclusion import Exclusion, exclusion_kind
from muloco.comm.hivemind.payloads import MulocoCompression, payload_token, wrap_payload
from muloco.comm.hivemind.settings import HANDLE_SLACK_S, SyncTimeouts
from muloco.comm.hivemind.transfer import (
    PayloadServer,
    checked_download,
    decode_payloads,
    download_all,
    download_limit,
    handler_name,
)
from muloco.compress import CompressionError
from muloco.config import HivemindBackendConfig

log = logging.getLogger("muloco")


@dataclass
class AverageResult:
    """The outcome of one sync of one fragment."""

    mean: list[torch.Tensor] | None  # fp32 CPU tensors; None: nothing to apply (see averaged)
    group_size: int  # peers in the group, this one included (1: no group)
    excluded: int  # group members whose contribution was dropped (excluded_reasons says why)
    averaged: bool  # False: no usable group; mean = own decoded contribution (apply_own) or None (skip)
    excluded_reasons: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    seconds: dict[str, float] = field(default_factory=dict)  # encode, matchmaking, exchange, combine
    # The state digests the group's members announced (authenticated, at this step; this peer's included):
    # every member sees the same, so each can tell whether it holds the same model as the others.
    digests: dict[str, bytes] = field(default_factory=dict)
    # The group's other members were at a later outer step: this peer is a sync behind them, which the
    # swarm's published progress may not show yet (they are finishing this same round).
    behind_group: bool = False

    @property
    def contributors(self) -> int:
        return self.group_size - self.excluded if self.averaged else int(self.mean is not None)

    def exclusions(self, own: str) -> tuple[int, dict[str, int]]:
        """(1 if this peer's own contribution was left out as non-finite, else 0; the other exclusions
        counted by the kind each was tagged with, exclusion.Exclusion)."""
        own_non_finite, kinds = 0, {}
        for peer, reason in self.excluded_reasons.items():
            kind = exclusion_kind(reason)
            if peer == own and kind == "non_finite":
                own_non_finite = 1
            else:
                kinds[kind] = kinds.get(kind, 0) + 1
        return own_non_finite, kinds


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
    problem: Exclusion | None  # why this peer sends nothing (e.g. non-finite values)
    token: bytes = b""
    rule: tuple[str, int] = ("mean", 1)  # (sync.aggregate, sync.trim): how the group combines
    digest: bytes = b""  # this peer's global state digest when the sync starts (state_sharing.py)
    wait_s: float = 0.0  # how long a group it leads waits for members (sync.deadline); 0: matchmaking_time
    late: bool = False  # a window that missed its own sync (sync.deadline): it joins the next one


class FragmentSync:
    """The syncs of one fragment p (steps 1-4 above), one at a time: the next starts after the previous
    one's wait(). Built by HivemindSwarm once its runtime (lifecycle.SwarmRuntime) has started."""

    def __init__(
        self,
        *,
        fragment: int,
        shapes: list[torch.Size],
        codecs: list[MulocoCompression],
        timeouts: SyncTimeouts,
        settings: HivemindBackendConfig,
        peer_id: PeerID,
        auth: SwarmAuth,
        averager: DecentralizedAverager,
        payloads: PayloadServer,
        runtime,  # lifecycle.SwarmRuntime: its executor runs the syncs, its loop and p2p the downloads
    ) -> None:
        self.fragment, self.shapes, self.codecs, self.timeouts = fragment, shapes, codecs, timeouts
        self.settings, self.peer_id, self.averager, self.auth = settings, peer_id, averager, auth
        self.payloads, self.runtime = payloads, runtime
        self.pending: concurrent.futures.Future | None = None

    def busy(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def start(
        self,
        tensors: list[torch.Tensor],
        step: int,
        rule: tuple[str, int],
        digest: bytes,
        wait_s: float = 0.0,
        late: bool = False,
    ) -> AveragingHandle:
        """Step 1 (encode) now, so the caller may reuse the tensors; the rest in the executor."""
        if len(tensors) != len(self.shapes) or any(
            t.shape != s for t, s in zip(tensors, self.shapes, strict=False)
        ):
            raise ValueError(
                f"fragment {self.fragment}: got shapes {[tuple(t.shape) for t in tensors]}, the swarm was "
                f"built for {[tuple(s) for s in self.shapes]}"
            )
        t0 = time.perf_counter()
        try:
            messages = [codec.compress(t) for codec, t in zip(self.codecs, tensors, strict=True)]
        except CompressionError as exc:
            own = _Contribution(int(step), None, None, withheld(str(exc)))
        else:
            own = self.own_contribution(int(step), messages)
        own.rule, own.digest, own.wait_s, own.late = rule, digest, wait_s, late
        return self.launch(own, time.perf_counter() - t0)

    def start_encoded(
        self,
        payloads: list[bytes],
        step: int,
        rule: tuple[str, int],
        digest: bytes,
        wait_s: float = 0.0,
        late: bool = False,
    ) -> AveragingHandle:
        own = self.own_contribution(int(step), [wrap_payload(p) for p in payloads])
        own.rule, own.digest, own.wait_s, own.late = rule, digest, wait_s, late
        return self.launch(own, 0.0)

    def own_contribution(self, step: int, messages: list[runtime_pb2.Tensor]) -> _Contribution:
        """Decode our own payloads exactly as the group will, so the mean uses the same bytes everywhere."""
        try:
            decoded = decode_payloads(self.codecs, messages)
        except CompressionError as exc:
            return _Contribution(step, None, None, withheld(str(exc)))
        problem = contribution_problem(decoded, self.shapes)
        if problem is not None:
            return _Contribution(step, None, None, withheld(problem))
        return _Contribution(step, messages, decoded, None, payload_token(messages))

    def launch(self, own: _Contribution, encode_s: float) -> AveragingHandle:
        if own.messages is not None:
            self.payloads.offer(self.fragment, own.token, own.messages)
        else:
            log.warning(
                "hivemind fragment=%d step=%d sends nothing: %s", self.fragment, own.step, own.problem
            )
        self.pending = self.runtime.executor.submit(self._sync, own, encode_s)
        return AveragingHandle(
            self.pending,
            partial(self._no_group, own, {"encode": encode_s}),
            own.wait_s + self.timeouts.worst_case + HANDLE_SLACK_S,
        )

    def _sync(self, own: _Contribution, encode_s: float) -> AverageResult:
        """Matchmaking, exchange, combine (runs in the executor). Every member applies the same rule to
        the same bytes, so members that downloaded the same payloads hold the same mean, bit for bit."""
        fragment, seconds = self.fragment, {"encode": encode_s}
        t0 = time.perf_counter()
        members = self._find_group(own)
        seconds["matchmaking"] = time.perf_counter() - t0
        if members is None:
            return self._no_group(own, seconds)
        if all(meta.get("late") is True for meta in members.values()):
            # Late windows only (sync.deadline): averaged among themselves, they would sync the step
            # before the workers it is due to, who would then see the swarm past them and be late in
            # turn. Every member sees the same metadata, so all give it up alike.
            log.info("hivemind fragment=%d step=%d: a group of late windows only", fragment, own.step)
            return self._no_group(own, seconds)

        if own.messages is not None:
            self.payloads.owe(own.token, len(members) - 1, self.timeouts.averaging_timeout)
        t1 = time.perf_counter()
        tokens, reasons, digests = self._tokens_to_fetch(own, members)
        requests = {
            p: t + self.auth.tag("payload request", fragment, self.peer_id, t) for p, t in tokens.items()
        }
        downloads = download_all(
            self.runtime.loop,
            self.runtime.p2p,
            handler_name(self.settings.run_id, fragment),
            tokens,
            requests=requests,
            limit=download_limit(self.timeouts.sync_bytes, len(self.shapes)),
            timeout=self.timeouts.averaging_timeout,
            messages=len(self.shapes),
        )
        seconds["exchange"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        contributions = self._contributions(own, tokens, downloads, reasons)
        norms = {str(peer): contribution_norm(t) for peer, t in contributions.items()}
        reasons.update(norm_outliers(norms, self.settings.max_norm_ratio))
        used = sorted((p for p in contributions if str(p) not in reasons), key=lambda p: p.to_bytes())
        for peer, why in reasons.items():
            log.warning(
                "hivemind excluded peer=%s fragment=%d step=%d reason=%s", peer, fragment, own.step, why
            )
        others = any(p != self.peer_id for p in used)
        # trimmed_mean tolerates sync.trim = f bad contributions only among 2f + 1 or more (with fewer it
        # trims fewer, down to the plain mean of a pair): a group left that small after its exclusions
        # would let an insider in, so it is combined as no group at all.
        trim = int(own.rule[1])
        robust_short = own.rule[0] == "trimmed_mean" and len(used) < robust_minimum(trim)
        if robust_short and others:
            log.warning(
                "hivemind fragment=%d step=%d: %d usable contributions, fewer than the %d that "
                "sync.trim=%d needs: combined as no group",
                *(fragment, own.step, len(used), robust_minimum(trim), trim),
            )
        mean = aggregate([contributions[p] for p in used], *own.rule) if others and not robust_short else None
        seconds["combine"] = time.perf_counter() - t2
        if mean is None or contribution_problem(mean, self.shapes) is not None:
            # Nobody else's contribution is usable, too few for the robust rule, or finite inputs overflowed:
            # as if there were no group.
            # A peer behind its group (the others at a later step) does not go its own way: it loads the
            # swarm's state after the sync (sync/swarm.py).
            behind = any(
                exclusion_kind(reasons.get(str(peer), "")) == "other_step" and meta["step"] > own.step
                for peer, meta in members.items()
            )
            result = self._no_group(own, seconds, str(self.peer_id) in reasons, behind)
            result.group_size, result.excluded, result.excluded_reasons = len(members), len(reasons), reasons
            result.digests, result.behind_group = digests, behind
            return result
        log.info(
            "hivemind sync fragment=%d step=%d group=%d used=%d excluded=%d matchmaking_s=%.2f "
            "exchange_s=%.2f combine_s=%.2f",
            *(fragment, own.step, len(members), len(used), len(reasons)),
            *(seconds["matchmaking"], seconds["exchange"], seconds["combine"]),
        )
        return AverageResult(mean, len(members), len(reasons), True, reasons, seconds, digests)

    def _find_group(self, own: _Contribution) -> dict[PeerID, dict] | None:
        """hivemind matchmaking: the group's members and their metadata, or None (no group in time).

        Blocks up to the group deadline; hivemind retries matchmaking (and a failed dummy all-reduce) until
        then. A peer that finds nobody in time gets None here and applies on_no_group."""
        t = self.timeouts
        if not self.averager.is_alive():
            log.error("hivemind averager of fragment %d is not running: no group", self.fragment)
            return None
        token = own.token if own.messages is not None else None
        rule = [own.rule[0], int(own.rule[1])]
        fields = (self.fragment, own.step, self.peer_id, token or b"", own.digest, *rule)
        tag = self.auth.tag("group metadata", *fields)
        meta = {"step": own.step, "token": token, "digest": own.digest, "rule": rule, "tag": tag}
        meta["late"] = own.late  # not in the tag: a member that lies about it can only make a group fail
        control = None
        # sync.deadline: the group may begin wait_s from now (hivemind's scheduled_time: a leader waits
        # for members until then, a full group begins at once); the search lasts that much longer.
        schedule = {"scheduled_time": get_dht_time() + own.wait_s} if own.wait_s > 0 else {}
        timeout = own.wait_s + t.group_deadline
        try:
            control = self.averager.step(
                gather=meta, timeout=timeout, allow_retries=True, wait=False, **schedule
            )
            gathered = control.result(timeout=timeout + t.averaging_timeout)
        except Exception as exc:  # MatchmakingException, AllreduceException, TimeoutError, a closed pipe
            log.info(
                "hivemind fragment=%d step=%d: no group (%s)", self.fragment, own.step, type(exc).__name__
            )
            if control is not None and not control.done():
                control.cancel()  # frees the averager for the next sync
            return None
        if not isinstance(gathered, dict) or len(gathered) < 2:
            return None
        return gathered

    def _no_group(
        self, own: _Contribution, seconds: dict, own_excluded: bool = False, behind: bool = False
    ) -> AverageResult:
        apply_own = self.settings.on_no_group == "apply_own" and own.decoded is not None
        apply_own = apply_own and not (own_excluded or behind)
        mean = [t.clone() for t in own.decoded] if apply_own else None
        outcome = "applying own" if apply_own else "skipping (behind the group)" if behind else "skipping"
        log.info("hivemind step=%d: no group, %s", own.step, outcome)
        return AverageResult(mean, 1, 0, False, {}, dict(seconds))

    def _tokens_to_fetch(
        self, own: _Contribution, members: dict[PeerID, dict]
    ) -> tuple[dict[PeerID, bytes], dict[str, str], dict[str, bytes]]:
        """The other members' payload tokens, and the state digests of the members at this step; a member
        without the swarm key, at another outer step or with malformed metadata is excluded without a
        download (every member decides alike: they all gathered the same metadata)."""
        tokens, reasons, digests = {}, {}, {str(self.peer_id): own.digest}
        for peer, meta in members.items():
            if peer == self.peer_id:
                continue
            problem = unauthenticated_metadata(self.auth, self.fragment, peer, meta)
            problem = problem or _metadata_problem(meta, own.step, own.rule)
            if problem is not None and problem.kind != "non_finite":  # withheld: its digest still counts
                reasons[str(peer)] = problem
                continue
            if isinstance(meta.get("digest"), bytes):
                digests[str(peer)] = meta["digest"]
            if problem is None:
                tokens[peer] = meta["token"]
            else:
                reasons[str(peer)] = problem
        return tokens, reasons, digests

    def _contributions(
        self,
        own: _Contribution,
        tokens: dict[PeerID, bytes],
        downloads: dict[PeerID, list[runtime_pb2.Tensor] | str],
        reasons: dict[str, str],
    ) -> dict[PeerID, list[torch.Tensor]]:
        """Decode and check every contribution, own included; record why each bad one is excluded."""
        checked = {self.peer_id: own.problem if own.decoded is None else self._checked(own.decoded)}
        for peer, token in tokens.items():
            checked[peer] = checked_download(downloads[peer], token, self.codecs, self.shapes)
        for peer, result in checked.items():
            if isinstance(result, str):
                reasons[str(peer)] = result
        return {peer: result for peer, result in checked.items() if not isinstance(result, str)}

    def _checked(self, decoded: list[torch.Tensor]) -> list[torch.Tensor] | str:
        return contribution_problem(decoded, self.shapes) or decoded
