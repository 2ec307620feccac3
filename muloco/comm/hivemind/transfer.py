"""Payloads between the members of a group (step 3 of a sync, see exchange.py): each peer serves its own
over hivemind's P2P under a token (a hash of the payloads), and downloads the other members' by token; a
download counts once it matches its token, decodes and passes the checks of combine.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from muloco.comm.hivemind import mismatch
from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.combine import contribution_problem
from muloco.comm.hivemind.exclusion import Exclusion
from muloco.comm.hivemind.payloads import MulocoCompression, payload_token
from muloco.comm.hivemind.settings import HANDLE_SLACK_S
from muloco.compress import CompressionError

log = logging.getLogger("muloco")

CHUNK_BYTES = 1 << 20  # payload stream chunks (hivemind's stream messages have no size limit)
SERVED_SYNCS = 2  # payloads kept per fragment: a fast peer may start its next sync while others download
# A download counts as served once the handler has handed its last chunk to the p2p daemon, before the peer
# has it: close() waits this much longer before shutting the daemon down.
DELIVERY_GRACE_S = 0.5
TOKEN_BYTES = 16  # payloads.payload_token
DOWNLOAD_ATTEMPTS = 3  # per member and sync, within its averaging_timeout
MESSAGE_OVERHEAD = 64  # bytes counted per streamed message on top of its payload (a bound on the count)


def handler_name(run_id: str, fragment: int) -> str:
    """The P2P handler that serves fragment `fragment`'s payloads (the same name on every peer)."""
    return f"muloco_{run_id}_fragment{fragment}_payloads"


class PayloadServer:
    """This peer's side of the exchange: its payloads by fragment and token, and the downloads of them
    that its recent groups still owe. `serve` runs on the P2P loop; the rest is called from the syncs and
    from close(), so every access holds `lock`."""

    def __init__(self, fragments: int, auth: SwarmAuth) -> None:
        self.auth = auth
        self.lock = threading.Lock()
        self.served: list[OrderedDict[bytes, list[runtime_pb2.Tensor]]] = [
            OrderedDict() for _ in range(fragments)
        ]
        # Downloads of this peer's payloads that its last groups still owe: token -> [left, deadline].
        # close() serves them before it stops, so a run's last sync is not cut off for slower members.
        self.owed: dict[bytes, list[float]] = {}
        # Downloads served per token still offered. A member whose group formed first can download before
        # this peer's own matchmaking returns and calls owe(): those count against what is owed (without
        # this, close() waited a whole averaging_timeout for downloads that had already happened).
        self.delivered: dict[bytes, int] = {}

    def offer(self, fragment: int, token: bytes, messages: list[runtime_pb2.Tensor]) -> None:
        """Serve `messages` under `token` until SERVED_SYNCS newer syncs of this fragment replace them."""
        if (dump := mismatch.dump_dir()) is not None:  # diagnostics (mismatch.py): what was meant
            mismatch.write_atomic(
                dump / "served" / f"{token.hex()}.bin", mismatch.encode([m.buffer for m in messages])
            )
        with self.lock:
            served = self.served[fragment]
            served[token] = messages
            while len(served) > SERVED_SYNCS:
                dropped, _ = served.popitem(last=False)
                self.delivered.pop(dropped, None)

    def owe(self, token: bytes, downloads: int, within_s: float) -> None:
        """A group formed: `downloads` members will fetch `token`'s payloads within `within_s` seconds."""
        with self.lock:
            now = time.monotonic()
            self.owed = {k: v for k, v in self.owed.items() if v[0] > 0 and v[1] > now}
            self.owed[token] = [downloads - self.delivered.get(token, 0), now + within_s]

    async def serve(
        self, fragment: int, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """P2P handler: stream the payloads whose token the requester names (request.metadata: the token,
        then the requester's tag over it), to an authenticated requester only."""
        token, tag = bytes(request.metadata[:TOKEN_BYTES]), bytes(request.metadata[TOKEN_BYTES:])
        requester = context.remote_id
        if self.auth.check(requester, "payload request", tag, fragment, requester, token) is not None:
            return
        with self.lock:
            messages = self.served[fragment].get(token)
        if messages is None:
            return  # an empty stream: the requester records "payload unavailable"
        for message in messages:
            for part in split_for_streaming(message, CHUNK_BYTES):
                yield averaging_pb2.DownloadData(tensor_part=part)
        with self.lock:
            if token in self.served[fragment]:
                self.delivered[token] = self.delivered.get(token, 0) + 1
            owed = self.owed.get(token)
            if owed is not None:
                owed[0] -= 1

    def serve_what_is_owed(self) -> None:
        """Keep serving until every member of this peer's recent groups has downloaded its payloads, or
        their averaging_timeout has passed: a fast peer ending its run must not cut the last sync's
        downloads of slower members short (over a slow link they take seconds)."""
        started = time.monotonic()
        with self.lock:
            recent = any(deadline > started for _, deadline in self.owed.values())
        while True:
            with self.lock:
                waiting = [d for left, d in self.owed.values() if left > 0 and d > time.monotonic()]
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


async def _download(p2p, name: str, peer: PeerID, request: bytes, limit: int) -> list[runtime_pb2.Tensor]:
    """One member's payloads; a stream of more than `limit` bytes is cut off (a bad peer)."""
    stream = await p2p.iterate_protobuf_handler(
        peer, name, averaging_pb2.DownloadData(metadata=request), averaging_pb2.DownloadData
    )
    messages, parts, received = [], [], 0
    async for reply in stream:
        part = reply.tensor_part
        received += len(part.buffer) + MESSAGE_OVERHEAD  # a stream of empty messages must also end
        if received > limit:
            raise CompressionError(f"sent more than the {limit} bytes this fragment's payloads take")
        if part.dtype and parts:  # a set dtype starts the next tensor (hivemind's streaming convention)
            messages.append(combine_from_streaming(parts))
            parts = []
        parts.append(part)
    if parts:
        messages.append(combine_from_streaming(parts))
    return messages


def cut_short(got: list[runtime_pb2.Tensor], messages: int) -> str | None:
    """How a download was cut short (fewer than the fragment's `messages`, or a message holding fewer bytes
    than it declares: wrap_payload's size), or None."""
    if len(got) < messages:
        return f"{len(got)} of {messages} messages"
    for i, m in enumerate(got):
        declared = list(m.size)
        if len(declared) == 1 and len(m.buffer) < declared[0]:
            return f"message {i} holds {len(m.buffer)} of {declared[0]} bytes"
    return None


def download_limit(sync_bytes: int, tensors: int) -> int:
    """The most a member's payloads of a fragment may take on the wire, with every message's overhead
    counted: more than ours take (64 KiB of slack), so a member sending more is a bad peer."""
    messages = tensors + sync_bytes // CHUNK_BYTES + 1
    return sync_bytes + 64 * 1024 + MESSAGE_OVERHEAD * messages


def download_all(
    loop,
    p2p,
    name: str,
    tokens: dict[PeerID, bytes],
    *,
    requests: dict[PeerID, bytes],
    limit: int,
    timeout: float,
    messages: int,
) -> dict[PeerID, list[runtime_pb2.Tensor] | str]:
    """Every member's payloads from handler `name`, concurrently on `loop` (lifecycle._EventLoopThread),
    each within `timeout`; requests[peer] is what to ask it (the token and this peer's tag). Failures as
    reasons. Blocks at most timeout + HANDLE_SLACK_S."""

    async def attempts(peer: PeerID, token: bytes):
        # A download cut short, or whose bytes do not hash to the announced token, is asked for again: a
        # member that drops a contribution the others keep leaves the group's models apart until the
        # digests realign it. Under load some arrived cut short: hivemind's P2P reads a response stream
        # that the connection ends early as a complete one (docs/reliability.md), so the messages' count
        # and declared sizes are checked first. An empty stream is asked for again too: a live member's
        # stream that its connection ended before the first message reads the same as "not served" (a
        # survivor of a killed member's group excluded another survivor so, in CI). A member that really
        # does not serve the token answers each attempt at once; one that died fails to dial.
        for attempt in range(DOWNLOAD_ATTEMPTS):
            got = await _download(p2p, name, peer, requests[peer], limit)
            short = cut_short(got, messages)
            if short is not None:
                log.warning(
                    "hivemind: payloads from peer=%s arrived cut short (%s; attempt %d): asking again",
                    *(peer, short, attempt + 1),
                )
                continue
            if payload_token(got) == token:
                return got
            if (dump := mismatch.dump_dir()) is not None:  # diagnostics (mismatch.py): what arrived
                where = dump / "received" / f"{os.getpid()}-{peer}-{token.hex()}-{attempt}.bin"
                mismatch.write_atomic(where, mismatch.encode([m.buffer for m in got]))
            log.warning(
                "hivemind: payloads from peer=%s do not match its token (%d messages, %d bytes; attempt %d)",
                *(peer, len(got), sum(len(m.buffer) for m in got), attempt + 1),
            )
        return got

    async def one(peer: PeerID, token: bytes):
        try:
            return await asyncio.wait_for(attempts(peer, token), timeout)
        except asyncio.TimeoutError:
            return Exclusion("download", f"download timed out after {timeout:.1f} s")
        except Exception as exc:  # the peer left, refused, or streamed garbage
            return Exclusion("download", f"download failed: {type(exc).__name__}: {exc}")

    async def all_of_them():
        results = await asyncio.gather(*(one(p, t) for p, t in tokens.items()))
        return dict(zip(tokens, results, strict=True))

    if not tokens:
        return {}
    try:
        return loop.run(all_of_them(), timeout=timeout + HANDLE_SLACK_S)
    except (concurrent.futures.TimeoutError, RuntimeError):  # RuntimeError: the swarm was closed
        return {p: Exclusion("download", "download did not finish") for p in tokens}


def decode_payloads(
    codecs: list[MulocoCompression], messages: list[runtime_pb2.Tensor]
) -> list[torch.Tensor]:
    """One contribution's tensors decoded with the fragment's codecs; CompressionError if they do not fit."""
    if len(messages) != len(codecs):
        raise CompressionError(f"{len(messages)} payloads, expected {len(codecs)}")
    return [codec.extract(m) for codec, m in zip(codecs, messages, strict=True)]


def checked_download(
    got: list[runtime_pb2.Tensor] | str,
    token: bytes,
    codecs: list[MulocoCompression],
    shapes: list[torch.Size],
) -> list[torch.Tensor] | str:
    """A member's decoded, checked contribution, or why it is excluded."""
    if isinstance(got, str):
        return got  # the download failed
    if not got:
        return Exclusion("download", "payload unavailable (the peer left, or no longer serves it)")
    if (short := cut_short(got, len(codecs))) is not None:
        return Exclusion("truncated", f"payloads arrived cut short: {short}")
    if payload_token(got) != token:
        return Exclusion("token_mismatch", "payloads do not match the token the peer announced")
    try:
        decoded = decode_payloads(codecs, got)
    except CompressionError as exc:
        return Exclusion("malformed", f"undecodable: {exc}")
    return contribution_problem(decoded, shapes) or decoded
