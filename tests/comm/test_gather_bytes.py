"""The torch backend's all-gather and all-to-all of byte payloads: with a bound on every payload (what a
compressed sync knows from its codec) each is one collective, and returns what the two-collective form
returns."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muloco.net.launch import free_port

pytestmark = pytest.mark.slow
RANK_SCRIPT = Path(__file__).with_name("gather_bytes_rank.py")


# Time (~6 s): three gloo processes on loopback.
def test_bounded_all_gather_and_all_to_all_return_every_payload_in_rank_order():
    env = {**os.environ, "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in range(3)
    ]
    try:
        results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait(timeout=10)
    assert all(r["ok"] for r in results)
    assert "a payload of 768 bytes exceeds its bound 10" in results[2]["refused"]
