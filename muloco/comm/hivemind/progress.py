"""Progress records: each peer's outer step in the DHT, so that a slow peer sees it is behind.

One DHT key per run (f"{run_id}_outer_step") with one subkey per peer (its peer id); a record expires
outer_step_ttl seconds after it was published, so a peer that left drops out of the swarm's outer step.
"""

from __future__ import annotations

import logging

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from muloco.comm.hivemind.settings import DHT_OP_TIMEOUT_S, is_int

log = logging.getLogger("muloco")


class ProgressRecords:
    """This peer's view of the swarm's outer steps: publish its own, read everyone's. Every DHT call is
    bounded by DHT_OP_TIMEOUT_S; a failure is logged and read as "nothing known"."""

    def __init__(self, dht: hivemind.DHT, peer_id: PeerID, run_id: str, ttl: float) -> None:
        self.dht, self.peer_id, self.ttl = dht, peer_id, ttl
        self.key = f"{run_id}_outer_step"

    def publish(self, outer_step: int) -> None:
        """Record this peer's outer step in the DHT (expires after ttl without a newer one)."""
        expiration = get_dht_time() + self.ttl
        future = self.dht.store(
            self.key, int(outer_step), expiration, subkey=self.peer_id.to_bytes(), return_future=True
        )
        try:
            future.result(timeout=DHT_OP_TIMEOUT_S)
        except Exception as exc:
            log.warning("hivemind: could not publish outer_step=%d: %s", outer_step, exc)

    def by_peer(self) -> dict[str, int]:
        """Peer id -> the outer step it published, for every live peer (this one included, once it
        published); empty if the DHT has none or cannot be read in time."""
        future = self.dht.get(self.key, latest=True, return_future=True)
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
            and is_int(v.value)
            and v.expiration_time > now
        }

    def highest(self) -> int | None:
        """The highest outer step live peers published (this one's included), or None if none is known."""
        return max(self.by_peer().values(), default=None)
