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


def test_a_download_cut_short_or_not_matching_its_token_is_asked_for_again(monkeypatch):
    """Under load some downloads arrived cut short (hivemind's P2P ends a response stream whose connection
    closed early as if it were complete: docs/reliability.md): the member that dropped that contribution
    held another model than the group's. A download cut short (fewer messages, or fewer bytes than a
    message declares, or no message at all) or not matching its token is asked for again, at most
    DOWNLOAD_ATTEMPTS times; what is still wrong is reported by what is wrong."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from muloco.comm.hivemind import transfer
    from muloco.comm.hivemind.exclusion import exclusion_kind
    from muloco.comm.hivemind.payloads import payload_token

    good = [runtime_pb2.Tensor(buffer=b"payload", dtype="uint8", size=[7])]
    cut = [runtime_pb2.Tensor(buffer=b"pay", dtype="uint8", size=[7])]
    altered = [runtime_pb2.Tensor(buffer=b"paXload", dtype="uint8", size=[7])]
    served = {
        "flaky": [cut, good],
        "short": [cut] * 5,
        "altered": [altered] * 5,
        "dropped": [[], good],  # a stream its connection ended before the first message
        "gone": [[]] * 5,  # a member that no longer serves the token
    }
    asked = []

    async def fake_download(p2p, name, peer, request, limit):
        asked.append(peer)
        if peer == refusing:
            raise ConnectionResetError("the peer left")
        return served[peer.to_bytes().decode()].pop(0)

    class Loop:
        def run(self, coroutine, timeout):
            return asyncio.run(coroutine)

    monkeypatch.setattr(transfer, "_download", fake_download)
    flaky, short, wrong = PeerID(b"flaky"), PeerID(b"short"), PeerID(b"altered")
    dropped, gone, refusing = PeerID(b"dropped"), PeerID(b"gone"), PeerID(b"refusing")
    tokens = dict.fromkeys((flaky, short, wrong, dropped, gone, refusing), payload_token(good))
    got = transfer.download_all(
        Loop(), None, "h", tokens, requests=dict.fromkeys(tokens, b""), limit=99, timeout=5, messages=1
    )
    assert got[flaky] == good and asked.count(flaky) == 2
    assert got[dropped] == good and asked.count(dropped) == 2
    assert asked.count(short) == asked.count(wrong) == asked.count(gone) == transfer.DOWNLOAD_ATTEMPTS
    assert transfer.checked_download(got[gone], tokens[gone], [None], []).startswith("payload unavailable")
    assert got[refusing] == "download failed: ConnectionResetError: the peer left"
    assert exclusion_kind(got[refusing]) == "download"
    assert transfer.checked_download(got[short], tokens[short], [None], []) == (
        "payloads arrived cut short: message 0 holds 3 of 7 bytes"
    )
    assert transfer.checked_download(got[wrong], tokens[wrong], [None], []) == (
        "payloads do not match the token the peer announced"
    )
    assert transfer.cut_short([], 2) == "0 of 2 messages" and transfer.cut_short(good, 1) is None


def test_a_download_served_before_this_peer_owes_it_counts():
    """A member whose group formed first downloads this peer's payloads before this peer's own matchmaking
    returns and calls owe(): that download counts, so close() does not wait a whole averaging_timeout for it
    (it did: 'served the last sync's payloads for 15.1 s before leaving', in every 2-peer loopback run)."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2, runtime_pb2

    server = PayloadServer(1, SwarmAuth("run"))
    token = b"t" * 16
    server.offer(0, token, [runtime_pb2.Tensor(buffer=b"\0" * 8, size=[2], dtype="float32")])
    request = averaging_pb2.DownloadData(metadata=token)  # no swarm key: no tag

    async def download() -> int:
        context = SimpleNamespace(remote_id="member")
        return len([part async for part in server.serve(0, request, context)])

    assert asyncio.run(download()) == 1  # served before owe()
    server.owe(token, downloads=1, within_s=30.0)
    t0 = time.monotonic()
    server.serve_what_is_owed()
    assert time.monotonic() - t0 < 2.0  # the delivery grace only, not the 30 s
    assert server.owed[token][0] == 0
