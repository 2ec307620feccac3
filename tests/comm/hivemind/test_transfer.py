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


def test_a_download_that_does_not_match_its_token_is_asked_for_again(monkeypatch):
    """Under load some downloads arrived altered (CI on 2 busy cores): the member that dropped that
    contribution held another model than the group's. A mismatch is now asked for again (at most
    DOWNLOAD_ATTEMPTS times); what still does not match is reported as before."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from muloco.comm.hivemind import transfer
    from muloco.comm.hivemind.payloads import payload_token

    good = [runtime_pb2.Tensor(buffer=b"payload", dtype="uint8", size=[7])]
    altered = [runtime_pb2.Tensor(buffer=b"pay", dtype="uint8", size=[7])]
    served = {"flaky": [altered, good], "broken": [altered] * 5}
    asked = []

    async def fake_download(p2p, name, peer, request, limit):
        asked.append(peer)
        return served[peer.to_bytes().decode()].pop(0)

    class Loop:
        def run(self, coroutine, timeout):
            return asyncio.run(coroutine)

    monkeypatch.setattr(transfer, "_download", fake_download)
    flaky, broken = PeerID(b"flaky"), PeerID(b"broken")
    tokens = {flaky: payload_token(good), broken: payload_token(good)}
    got = transfer.download_all(
        Loop(), None, "h", tokens, requests=dict.fromkeys(tokens, b""), limit=99, timeout=5
    )
    assert got[flaky] == good and asked.count(flaky) == 2
    assert asked.count(broken) == transfer.DOWNLOAD_ATTEMPTS
    assert transfer.checked_download(got[broken], tokens[broken], [], []) == (
        "payloads do not match the token the peer announced"
    )
