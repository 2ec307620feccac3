"""Who belongs to a swarm: a pre-shared key (backend.hivemind.auth.key_file) and, optionally, a list of
allowed peer ids. docs/security.md argues the design and lists what each guarantee rests on.

Every record a peer relies on carries an HMAC-SHA256 tag (RFC 2104) over the run_id, the record's kind and
its fields, the sender's peer id among them: a group member's metadata (step, payload token, state digest),
a payload download request, a state request and the state itself, a progress record in the DHT. The peer
ids come from libp2p, which authenticates them on every connection (each peer proves its identity key), so
a tag binds a record to the peer that sent it. Without a key, tags are empty and every peer is admitted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import stat
import struct
import threading
from pathlib import Path
from typing import TypeVar

from muloco.comm.hivemind.exclusion import Exclusion
from muloco.errors import ConfigError

_Reason = TypeVar("_Reason", bound=str)  # a record's rejection: a group exclusion (Exclusion) or a log text

log = logging.getLogger("muloco")

KEY_BYTES = 32  # HMAC-SHA256's block-sized key: 256 bits, as RFC 2104 recommends (>= the digest size)
_DOMAIN = b"muloco-swarm-auth-v1"
MAX_LOGGED = 10_000  # (peer, kind) pairs remembered for log-once


def write_key(path: str) -> None:
    """A new random key, hex-encoded, in a file created with mode 0600; never overwrites one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path}: already exists; remove it first or choose another path") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create the key file ({exc.strerror})") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")


def read_key(path: str) -> bytes:
    """The key in `path`; ConfigError (one line) if it is missing, readable by others, or malformed."""
    field = "backend.hivemind.auth.key_file"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(
            f"{field}: {path} does not exist; create one with `muloco swarm-key {path}`"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{field}: {path} is accessible by other users (mode {stat.S_IMODE(mode):o}); "
            f"run chmod 600 {path}"
        )
    try:
        key = bytes.fromhex(Path(path).read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(
            f"{field}: {path} does not hold a {2 * KEY_BYTES}-hex-digit key; make one with `muloco swarm-key`"
        )
    return key


def _encode(field: object) -> bytes:
    """One field as type byte + length + bytes, so that no two field lists encode alike; TypeError for a
    field that cannot be tagged (an int outside int64, a float that is not finite, another type)."""
    if isinstance(field, bytes):
        kind, raw = b"b", field
    elif isinstance(field, str):
        kind, raw = b"s", field.encode()
    elif isinstance(field, int) and not isinstance(field, bool):
        if not -(1 << 63) <= field < 1 << 63:
            raise TypeError(f"integer {field} is outside int64")
        kind, raw = b"i", field.to_bytes(8, "little", signed=True)
    elif isinstance(field, float):
        if not math.isfinite(field):
            raise TypeError(f"float {field} is not finite")
        kind, raw = b"f", struct.pack("<d", field)
    elif hasattr(field, "to_bytes"):  # a PeerID
        kind, raw = b"p", field.to_bytes()
    else:
        raise TypeError(f"cannot authenticate a field of type {type(field).__name__}")
    return kind + len(raw).to_bytes(4, "little") + raw


class SwarmAuth:
    """Tags records and checks other peers' tags. Rejections are logged once per peer and kind."""

    def __init__(self, run_id: str, key: bytes | None = None, allowed_peers: list[str] | None = None) -> None:
        self.run_id, self.key = run_id, key
        self.allowed = frozenset(allowed_peers) if allowed_peers is not None else None
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> SwarmAuth:
        """From backend.hivemind (HivemindBackendConfig): its auth section, else an open swarm (warned)."""
        section = settings.auth
        if section.key_file is None:
            log.warning(
                "hivemind: backend.hivemind.auth is not set: anyone who knows a peer's address and the "
                "run_id %r can join this swarm and contribute (docs/security.md)",
                settings.run_id,
            )
            return cls(settings.run_id)
        return cls(settings.run_id, read_key(section.key_file), section.allowed_peers)

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def tag(self, kind: str, *fields: object) -> bytes:
        """The HMAC-SHA256 of (run_id, kind, fields); b"" without a key."""
        if self.key is None:
            return b""
        message = b"".join(_encode(f) for f in (_DOMAIN, self.run_id, kind, *fields))
        return hmac.new(self.key, message, hashlib.sha256).digest()

    def check(self, peer: object, kind: str, tag: object, *fields: object) -> Exclusion | None:
        """Why `peer`'s record of this kind is rejected (logged once per peer and kind), or None.
        `fields` must include what binds the record to `peer` (its id) exactly as the sender tagged it."""
        if self.allowed is not None and str(peer) not in self.allowed:
            return self.reject(peer, kind, Exclusion("auth", "not in backend.hivemind.auth.allowed_peers"))
        if self.key is None:
            return None
        try:
            expected = self.tag(kind, *fields)
        except TypeError:
            return self.reject(peer, kind, Exclusion("malformed", "malformed record"))
        if not isinstance(tag, bytes) or not hmac.compare_digest(tag, expected):
            return self.reject(peer, kind, Exclusion("auth", "not authenticated (no or another swarm key)"))
        return None

    def reject(self, peer: object, kind: str, reason: _Reason) -> _Reason:
        """Log once per peer and kind that its record is rejected, and why; returns the reason."""
        with self._lock:
            first = (str(peer), kind) not in self._logged
            if len(self._logged) >= MAX_LOGGED:  # bounded under peer-id churn: start remembering anew
                self._logged.clear()
            self._logged.add((str(peer), kind))
        if first:
            log.warning("hivemind auth: rejected %s from peer=%s: %s", kind, peer, reason)
        return reason
