"""`muloco.DiLoCo` over a hivemind swarm: two peers of a user's own loop average every sync and end with the
same global parameters, bit for bit."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hivemind")
pytestmark = pytest.mark.slow

PEER = Path(__file__).resolve().parent / "diloco_peer.py"
MADDRS = re.compile(r"join with backend\.hivemind\.initial_peers=(\[.*\])")


def start_peer(index: int, initial_peers: list[str], tmp_path: Path) -> subprocess.Popen:
    """A peer whose log goes to tmp_path/peer<i>.log (a file: no pipe to fill up and block it)."""
    cmd = [
        sys.executable,
        str(PEER),
        str(index),
        json.dumps(initial_peers),
        str(tmp_path / f"peer{index}.json"),
    ]
    with open(tmp_path / f"peer{index}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def first_peer_maddrs(peer: subprocess.Popen, log: Path, timeout: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and peer.poll() is None:
        found = MADDRS.search(log.read_text())
        if found:
            return json.loads(found.group(1).replace("'", '"'))
        time.sleep(0.2)
    raise AssertionError(f"the first peer never printed its multiaddrs:\n{log.read_text()[-3000:]}")


def test_two_diloco_peers_stay_equal(tmp_path):
    peers = []
    try:
        peers.append(start_peer(0, [], tmp_path))
        maddrs = first_peer_maddrs(peers[0], tmp_path / "peer0.log")
        peers.append(start_peer(1, maddrs, tmp_path))
        for i, peer in enumerate(peers):
            peer.wait(timeout=240)
            assert peer.returncode == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait(timeout=30)
    results = [json.loads((tmp_path / f"peer{i}.json").read_text()) for i in range(2)]
    assert all(r["outer_steps"] == 3 for r in results)
    assert all(r["group_sizes"] == [2, 2, 2] for r in results)
    assert results[0]["sha256"] == results[1]["sha256"]
