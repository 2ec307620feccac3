"""Diagnostics for payloads that arrive with bytes that do not hash to their token (issue 37).

With MULOCO_PAYLOAD_DUMP=DIR set, every peer writes each payload it serves to DIR/served/<token>.bin and
each download whose bytes do not match its token to DIR/received/<pid>-<peer>-<token>-<attempt>.bin
(transfer.py). `classify` then tells what the received bytes are, against what the server meant to send
and every other payload served in the run: experiments/reliability/payload_stress.py runs a loaded swarm
with the dump on and tabulates the kinds. Off (the default), nothing is written.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

DUMP_ENV = "MULOCO_PAYLOAD_DUMP"


def dump_dir() -> Path | None:
    """Where payloads are dumped (MULOCO_PAYLOAD_DUMP), or None: off."""
    value = os.environ.get(DUMP_ENV)
    return Path(value) if value else None


def encode(buffers: list[bytes]) -> bytes:
    """Messages' buffers, each behind its 8-byte length (what the token hashes, in the same order)."""
    return b"".join(len(b).to_bytes(8, "little") + bytes(b) for b in buffers)


def decode(blob: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(blob):
        n = int.from_bytes(blob[i : i + 8], "little")
        out.append(blob[i + 8 : i + 8 + n])
        i += 8 + n
    return out


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def classify(received: list[bytes], sent: list[bytes] | None, others: dict[str, list[bytes]]) -> str:
    """What a mismatched download is, by the first rule that holds:
    - `unknown`: the server's payload was not kept (no dump of it);
    - `identical`: the same bytes (then the token itself was computed over other bytes);
    - `truncated`: a prefix of what was sent (fewer messages, or the last one cut short);
    - `reordered` / `duplicated`: the same messages in another order / some of them twice;
    - `other_payload`: exactly another payload served in the run (another peer's, step's or fragment's);
    - `bytes_flipped`: the same message lengths, a few bytes differ (the count in the kind);
    - `different`: none of these."""
    if sent is None:
        return "unknown"
    if received == sent:
        return "identical"
    joined_received, joined_sent = b"".join(received), b"".join(sent)
    if len(joined_received) < len(joined_sent) and joined_sent.startswith(joined_received):
        return "truncated"
    if Counter(received) == Counter(sent):
        return "reordered"
    if set(received) <= set(sent) and len(received) >= len(sent):
        return "duplicated"
    if any(received == payload for payload in others.values()):
        return "other_payload"
    if [len(b) for b in received] == [len(b) for b in sent]:
        flipped = sum(x != y for a, b in zip(received, sent, strict=True) for x, y in zip(a, b, strict=True))
        return f"bytes_flipped ({flipped} of {len(joined_sent)})"
    return "different"
