"""Serving payloads to the group (muloco/comm/hivemind/transfer.py); the downloads themselves are exercised
by the swarms of test_swarm.py."""

import threading
import time

import pytest

pytest.importorskip("hivemind")

from muloco.comm.hivemind.auth import SwarmAuth  # noqa: E402
from muloco.comm.hivemind.transfer import PayloadServer  # noqa: E402


def test_a_closing_peer_serves_what_its_last_group_still_downloads():
    """Found on the emulated WAN: a fast peer that ended its run cut the last sync's downloads of slower
    members short (they excluded its payload). close() now waits for the owed downloads, up to their
    averaging timeout."""
    server = PayloadServer(1, SwarmAuth("run"))  # what HivemindSwarm.close() drains before it stops
    now = time.monotonic()
    server.owed = {b"served": [2, now + 30.0], b"expired": [1, now - 1.0]}

    def two_members_download():
        for _ in range(2):
            time.sleep(0.3)
            with server.lock:
                server.owed[b"served"][0] -= 1

    threading.Thread(target=two_members_download).start()
    t0 = time.monotonic()
    server.serve_what_is_owed()
    assert 0.5 < time.monotonic() - t0 < 5.0  # waited for both downloads, not for the 30 s deadline
    assert server.owed[b"served"][0] == 0

    server.owed = {b"never": [1, time.monotonic() + 0.5]}  # a member that never comes: the deadline ends it
    t0 = time.monotonic()
    server.serve_what_is_owed()
    assert 0.4 < time.monotonic() - t0 < 3.0
