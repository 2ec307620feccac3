"""Progress records: each peer's progress (its fragment syncs) and state digest in the DHT, so that a slow
peer sees it is behind, a joiner finds donors, and anyone sees which peers hold which model.

One DHT key per run (f"{run_id}_outer_step") with one subkey per peer (its peer id); the value is
[progress, digest, tag], the tag the HMAC of both, the peer id and the record's expiration (auth.py); a
record expires outer_step_ttl seconds after it was published, so a peer that left drops out. Records that
are malformed or fail the tag are ignored (and logged once per peer), by the readers and by the DHT nodes
themselves (`SwarmRecordValidator`, which with a key also tags every other record of the DHT).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from muloco.comm.hivemind.auth import SwarmAuth
from muloco.comm.hivemind.settings import DHT_OP_TIMEOUT_S, is_int

log = logging.getLogger("muloco")

DIGEST_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
MAX_PROGRESS = 1 << 62  # far beyond any run; a larger claim is malformed
EXPIRATION_SLACK_S = 3600.0  # clock skew between peers; replays are stopped by the tag, not by this


def progress_key(run_id: str) -> str:
    return f"{run_id}_outer_step"


@dataclass(frozen=True)
class ProgressRecord:
    progress: int  # the peer's fragment syncs
    digest: bytes  # its global state's digest (comm/digest.py, state_digest); b"" before its first
    published: float = 0.0  # when (DHT time: expiration - ttl; peers' clocks may differ by their skew)


def record_problem(auth: SwarmAuth, peer: PeerID, value: object, expiration: float) -> str | None:
    """Why a progress record is ignored (malformed, or its tag fails), or None."""
    if not (
        isinstance(value, list)
        and len(value) == 3
        and is_int(value[0])
        and 0 <= value[0] < MAX_PROGRESS
        and isinstance(value[1], bytes)
        and len(value[1]) in (0, DIGEST_BYTES)
    ):
        return auth.reject(peer, "progress", "malformed progress record")
    return auth.check(peer, "progress", value[2], peer, value[0], value[1], float(expiration))


class SwarmRecordValidator(RecordValidatorBase):
    """The DHT's own check of every record another node asks this one to store, and of every record it
    finds. With the swarm key, each record's value carries a tag over (key, subkey, value, expiration),
    appended when a key holder stores it and stripped before hivemind reads it: a peer without the key can
    neither declare itself for matchmaking nor publish progress, and an old record cannot be replayed with
    a new expiration. This run's progress records must also be well formed (record_problem) and expire
    within ttl + slack of now, with or without a key: otherwise anyone could store one that expires in
    10^300 s under a peer's subkey and hide that peer's real records (the DHT keeps a subkey's
    latest-expiring value)."""

    def __init__(self, auth: SwarmAuth, run_id: str, ttl: float) -> None:
        self.auth, self.ttl = auth, ttl
        self.key_id = DHTID.generate(source=progress_key(run_id)).to_bytes()

    def _tag(self, record: DHTRecord, value: bytes) -> bytes:
        return self.auth.tag("dht record", record.key, record.subkey, value, float(record.expiration_time))

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + self._tag(record, record.value) if self.auth.enabled else record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-TAG_BYTES] if self.auth.enabled else record.value

    def validate(self, record: DHTRecord) -> bool:
        value = record.value
        if self.auth.enabled:
            value, tag = value[:-TAG_BYTES], value[-TAG_BYTES:]
            if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, self._tag(record, value)):
                self.auth.reject(
                    _sender(record.subkey), "DHT record", "not authenticated (no or another swarm key)"
                )
                return False
        if record.key != self.key_id:
            return True  # hivemind's own records (matchmaking): the tag is all we check
        if record.expiration_time > get_dht_time() + self.ttl + EXPIRATION_SLACK_S:
            return False
        try:
            peer = PeerID(MSGPackSerializer.loads(record.subkey))
            progress = MSGPackSerializer.loads(value)
        except Exception:
            return False
        return record_problem(self.auth, peer, progress, record.expiration_time) is None


def _sender(subkey: bytes) -> object:
    """Who a rejected DHT record names as its subkey (a peer id for progress and matchmaking records)."""
    try:
        return PeerID(MSGPackSerializer.loads(subkey))
    except Exception:
        return "an unknown peer"


class ProgressRecords:
    """This peer's view of the swarm's progress: publish its own, read everyone's. Every DHT call is
    bounded by DHT_OP_TIMEOUT_S; a failure is logged and read as "nothing known"."""

    def __init__(self, dht: hivemind.DHT, peer_id: PeerID, run_id: str, ttl: float, auth: SwarmAuth) -> None:
        self.dht, self.peer_id, self.ttl, self.auth = dht, peer_id, ttl, auth
        self.key = progress_key(run_id)

    def publish(self, progress: int, digest: bytes = b"") -> None:
        """Record this peer's progress and state digest (expires after ttl without a newer one)."""
        expiration = get_dht_time() + self.ttl
        tag = self.auth.tag("progress", self.peer_id, int(progress), digest, float(expiration))
        value = [int(progress), digest, tag]
        future = self.dht.store(
            self.key, value, expiration, subkey=self.peer_id.to_bytes(), return_future=True
        )
        try:
            future.result(timeout=DHT_OP_TIMEOUT_S)
        except Exception as exc:
            log.warning("hivemind: could not publish progress=%d: %s", progress, exc)

    def records(self) -> dict[PeerID, ProgressRecord]:
        """Every live, well-formed, authenticated record (this peer's included, once published); empty if
        the DHT has none or cannot be read in time."""
        future = self.dht.get(self.key, latest=True, return_future=True)
        try:
            found = future.result(timeout=DHT_OP_TIMEOUT_S)
        except Exception as exc:
            log.warning("hivemind: could not read the swarm's progress: %s", exc)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        now, out = get_dht_time(), {}
        for subkey, entry in found.value.items():
            if not (isinstance(entry, ValueWithExpiration) and entry.expiration_time > now):
                continue
            try:
                peer = PeerID(subkey)
            except Exception:
                continue  # not a peer id: nobody to blame
            if record_problem(self.auth, peer, entry.value, entry.expiration_time) is None:
                out[peer] = ProgressRecord(entry.value[0], entry.value[1], entry.expiration_time - self.ttl)
        return out

    def by_peer(self) -> dict[str, int]:
        """Peer id -> the progress it published, for every live authenticated peer."""
        return {str(peer): r.progress for peer, r in self.records().items()}

    def highest(self) -> int | None:
        """The highest progress live peers published (this one's included), or None if none is known."""
        return max(self.by_peer().values(), default=None)
