"""Start-up and shutdown of a swarm (muloco/comm/hivemind/lifecycle.py): the fork start method, a lone peer
that starts, syncs alone and leaves nothing behind."""

import subprocess
import sys

import pytest

pytest.importorskip("hivemind")

from muloco.comm.hivemind import lifecycle  # noqa: E402


def test_the_swarm_needs_the_fork_start_method(monkeypatch):
    monkeypatch.setattr(lifecycle.multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    with pytest.raises(RuntimeError, match="set_start_method\\('fork'"):
        lifecycle.require_fork_start_method()


ALONE = """
import signal, psutil, torch
from muloco.comm.hivemind import HivemindSwarm
from muloco.config import HivemindBackendConfig
handler = signal.getsignal(signal.SIGINT)
swarm = HivemindSwarm(HivemindBackendConfig(run_id="alone", matchmaking_time=0.5), [[torch.Size([3])]])
assert signal.getsignal(signal.SIGINT) is handler, "hivemind left SIGINT ignored"
result = swarm.start_average(0, [torch.ones(3)], step=0).wait()
assert (result.averaged, result.group_size) == (False, 1) and torch.equal(result.mean[0], torch.ones(3))
swarm.close()
swarm.close()  # idempotent
left = [c.name() for c in psutil.Process().children(recursive=True) if c.name() != "torch_shm_manager"]
assert not left, left
print("ok")
"""


@pytest.mark.slow
def test_a_lone_peer_applies_its_own_keeps_ctrl_c_and_closes_cleanly():
    done = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
