"""Joining and repairing: a peer serves its global state over P2P, and a peer that joins, falls behind or
holds another model than its group loads it from a donor it picks (progress.py lists them).

One P2P handler per run (`state_handler`). A request carries the requester's tag ("state request", its
peer id); the reply is a header (the state's step counters, its digest, the donor's tag over both and the
requester's id) followed by the tensors (global parameters, then outer momentum) in hivemind's tensor
stream. The requester checks the tag, every tensor against its own state's shapes, and the digest of what
it received: a donor without the swarm key, or one that sends something else than it tagged, is rejected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from muloco.comm.digest import state_digest
from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.settings import HANDLE_SLACK_S, is_int
from muloco.comm.hivemind.transfer import CHUNK_BYTES, MESSAGE_OVERHEAD

log = logging.getLogger("muloco")

COUNTERS = ("step", "outer_steps", "fragment_syncs")  # the metadata a state carries (SharedState)
HEADER_LIMIT = 4096  # a header holds three counters, a digest and a tag


def state_handler(run_id: str) -> str:
    return f"muloco_{run_id}_state"


class StateServer:
    """This peer's served state: a copy taken between syncs (never half-updated), and the P2P handler."""

    def __init__(self, auth: SwarmAuth, peer_id: PeerID) -> None:
        self.auth, self.peer_id = auth, peer_id
        self.lock = threading.Lock()
        self.state: tuple[list[torch.Tensor], bytes, bytes] | None = None  # tensors, metadata, digest
        self.serialized: tuple[list[torch.Tensor], list] | None = None  # (the tensors, their messages)

    def offer(self, tensors: list[torch.Tensor], meta: dict[str, int]) -> bytes:
        """Serve (copies of) these tensors and counters from now on; returns their digest."""
        if set(meta) != set(COUNTERS) or not all(is_int(v) for v in meta.values()):
            raise TypeError(f"state metadata must be the integer counters {COUNTERS}, got {meta!r}")
        copies = [t.detach().cpu().clone() for t in tensors]
        digest = state_digest(copies)
        with self.lock:
            self.state = (copies, MSGPackSerializer.dumps(meta), digest)
            self.serialized = None  # serialized once, at the first request for this state
        return digest

    def _serialized(self) -> tuple[list, bytes, bytes] | None:
        """The served state as tensor messages (cached), its metadata and digest; None before offer()."""
        with self.lock:
            if self.state is None:
                return None
            tensors, meta, digest = self.state
            if self.serialized is None or self.serialized[0] is not tensors:
                self.serialized = (tensors, [serialize_torch_tensor(t) for t in tensors])
            return self.serialized[1], meta, digest

    async def serve(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """P2P handler: the state, to a requester that proves it holds the key (else an empty stream)."""
        requester = context.remote_id
        if self.auth.check(requester, "state request", bytes(request.metadata), requester) is not None:
            return
        # Serializing a whole state takes a while: not on the P2P loop, which also serves the payloads.
        state = await asyncio.get_running_loop().run_in_executor(None, self._serialized)
        if state is None:
            return  # nothing to share yet: the requester tries another donor
        messages, meta, digest = state
        tag = self.auth.tag("state", self.peer_id, requester, digest, meta)
        header = MSGPackSerializer.dumps({"meta": meta, "digest": digest, "tag": tag})
        yield averaging_pb2.DownloadData(metadata=header)
        for message in messages:
            for part in split_for_streaming(message, CHUNK_BYTES):
                yield averaging_pb2.DownloadData(tensor_part=part)


async def _fetch(
    p2p, name: str, donor: PeerID, request: bytes, limit: int, unwanted: Callable[[bytes], str | None]
) -> tuple[bytes, list]:
    """The donor's header and tensor messages; more than `limit` bytes is cut off (a bad donor), and the
    download stops after the header when `unwanted(header)` gives a reason (an old or untrusted state)."""
    stream = await p2p.iterate_protobuf_handler(
        donor, name, averaging_pb2.DownloadData(metadata=request), averaging_pb2.DownloadData
    )
    header, messages, parts, received = b"", [], [], 0
    async for reply in stream:
        # + a message's overhead: a stream of empty messages must also end
        received += len(reply.metadata) + len(reply.tensor_part.buffer) + MESSAGE_OVERHEAD
        if received > limit:
            raise ValueError(f"sent more than the {limit} bytes a state of this model takes")
        if reply.metadata:
            header = bytes(reply.metadata)
            if (why := unwanted(header)) is not None:
                raise _Unwanted(why)
            continue
        if reply.tensor_part.dtype and parts:  # a set dtype starts the next tensor
            messages.append(combine_from_streaming(parts))
            parts = []
        parts.append(reply.tensor_part)
    if parts:
        messages.append(combine_from_streaming(parts))
    return header, messages


class _Unwanted(Exception):
    """A donor's header shows its state is not the one wanted: stop the download."""


def _header(header: bytes) -> tuple[dict, bytes, bytes, object] | None:
    """(counters, their serialized bytes, digest, tag) of a state header; None if malformed."""
    if len(header) > HEADER_LIMIT:
        return None
    try:
        fields = MSGPackSerializer.loads(header)
        meta_bytes, digest, tag = fields["meta"], fields["digest"], fields["tag"]
        meta = MSGPackSerializer.loads(meta_bytes)
    except Exception:
        return None
    if not (isinstance(meta_bytes, bytes) and isinstance(digest, bytes)):
        return None
    if not isinstance(meta, dict) or set(meta) != set(COUNTERS) or not all(is_int(v) for v in meta.values()):
        return None
    return meta, meta_bytes, digest, tag


def _checked_state(
    auth: SwarmAuth, donor: PeerID, me: PeerID, header: bytes, messages: list, like: list[torch.Tensor]
) -> tuple[list[torch.Tensor], dict[str, int]] | str:
    """The donor's state, or why it is rejected."""
    if not header:
        return "it shares no state"
    parsed = _header(header)
    if parsed is None:
        return "malformed state header"
    meta, meta_bytes, digest, tag = parsed
    rejected = auth.check(donor, "state", tag, donor, me, digest, meta_bytes)
    if rejected is not None:
        return rejected
    if len(messages) != len(like):
        return f"{len(messages)} tensors, this model's state has {len(like)}"
    try:
        tensors = [deserialize_torch_tensor(m) for m in messages]
    except Exception as exc:
        return f"undecodable tensors ({type(exc).__name__})"
    for i, (t, ref) in enumerate(zip(tensors, like, strict=True)):
        if t.shape != ref.shape or t.dtype != ref.dtype:
            return f"tensor {i} is {t.dtype} {tuple(t.shape)}, expected {ref.dtype} {tuple(ref.shape)}"
        if not bool(torch.isfinite(t).all()):
            return f"tensor {i} holds non-finite values"
    if state_digest(tensors) != digest:
        return "the tensors do not match the digest it tagged"
    return tensors, meta


def load_state(
    loop,
    p2p,
    name: str,
    auth: SwarmAuth,
    me: PeerID,
    donors: list[PeerID],
    like: list[torch.Tensor],
    timeout: float,
    min_progress: int = 0,
    digests: set[bytes] | None = None,
) -> tuple[list[torch.Tensor], dict[str, int], PeerID] | None:
    """The first donor's (in order) checked state with fragment_syncs >= min_progress and, when `digests`
    is given, a digest among them, within `timeout` overall; None if none qualifies (each rejection
    logged). like: this peer's own state tensors."""
    limit = sum(t.numel() * t.element_size() for t in like) + len(like) * 4096 + 2 * HEADER_LIMIT
    request = auth.tag("state request", me)
    deadline = time.monotonic() + timeout

    def unwanted(header: bytes) -> str | None:
        parsed = _header(header)
        if parsed is None:
            return None  # _checked_state says why
        meta, _, digest, _ = parsed
        if meta["fragment_syncs"] < min_progress:
            return f"it still serves progress {meta['fragment_syncs']} < {min_progress}"
        if digests is not None and digest not in digests:
            return "its state's digest is not one that enough peers announced"
        return None

    for donor in donors:
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("hivemind: no donor's state within %.0f s", timeout)
            return None
        try:
            coroutine = asyncio.wait_for(_fetch(p2p, name, donor, request, limit, unwanted), left)
            header, messages = loop.run(coroutine, timeout=left + HANDLE_SLACK_S)
        except _Unwanted as exc:
            log.info("hivemind: not loading the state of peer=%s: %s", donor, exc)
            continue
        except Exception as exc:  # the donor left, timed out, refused or streamed garbage
            log.info("hivemind: could not load state from peer=%s: %s: %s", donor, type(exc).__name__, exc)
            continue
        got = _checked_state(auth, donor, me, header, messages, like)
        if isinstance(got, str):
            log.warning("hivemind: state from peer=%s rejected: %s", donor, got)
            continue
        tensors, meta = got
        return tensors, meta, donor
    return None
