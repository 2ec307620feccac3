"""muloco over the emulated WAN (muloco.testbed.train): MuLoCo against DDP over a slow link, hivemind
peers and torchft workers on hosts of their own.

Needs root and iproute2; skipped with the reason where either is missing.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muloco.testbed.network import Testbed, missing_requirements
from muloco.testbed.train import train_on_testbed

ROOT = Path(__file__).resolve().parents[2]
REASON = missing_requirements()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network testbed here: {REASON}")


# -- a short run over the emulated WAN: MuLoCo sends less and waits less than DDP for the same tokens ------
TINY_WAN = [
    "model.preset=nano",
    "workers=2",
    "train.total_tokens=12288",  # 12 steps of 1024 tokens
    "train.batch_tokens=1024",
    "train.warmup_steps=2",
    "train.eval_every=0",
    "train.eval_tokens=2048",
    "sync.every=6",
    "checkpoint.resume=never",
]


@pytest.mark.slow
@needs_netns
# Time (~38 s): DDP and MuLoCo each over a 20 Mbit/s link between network namespaces: DDP's all-reduce at
# every step is the slow side the test measures.
def test_muloco_sends_less_and_waits_less_than_ddp_over_a_slow_link(tmp_path):
    rate = 20.0  # Mbit/s: a DDP step's 3.4 MB all-reduce takes ~1.4 s, far above its compute
    config = str(ROOT / "configs/quickstart.yaml")
    runs = {}
    with Testbed(2, rate) as testbed:
        for name, method in (("ddp", ["method=dp"]), ("muloco", [])):
            overrides = [*TINY_WAN, *method, f"run.name={name}", f"run.output_dir={tmp_path}"]
            run = train_on_testbed(testbed, config, overrides, tmp_path / f"{name}.logs", timeout_s=240)
            assert run.ok, f"{name}: exit codes {run.returncodes}; " + Path(run.logs[0]).read_text()[-2000:]
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            assert summary["status"] == "completed" and summary["tokens_seen"] == 12288
            runs[name] = (summary, run)
    ddp, muloco = runs["ddp"][0], runs["muloco"][0]
    # What muloco counts: 12 all-reduces of the fp32 gradients vs 2 of the fp32 pseudogradients.
    assert muloco["bytes_sent_per_worker"] == pytest.approx(ddp["bytes_sent_per_worker"] / 6)
    # What crossed the wire agrees (headers and the start-up broadcast of the parameters on top).
    for summary, run in runs.values():
        assert (
            summary["bytes_sent_per_worker"]
            < min(run.wire_sent)
            < 1.25 * summary["bytes_sent_per_worker"] + 4e6
        )
    # The link really is 20 Mbit/s: DDP cannot have waited less than its bytes take at that rate.
    assert ddp["comm_wait_s"] > 0.8 * 8 * ddp["bytes_sent_per_worker"] / (rate * 1e6)
    assert muloco["comm_wait_s"] < ddp["comm_wait_s"] / 3


@pytest.mark.slow
@needs_netns
def test_hivemind_peers_on_separate_hosts_average_every_sync(tmp_path):
    """Two peers on hosts of their own (their multiaddrs in 198.18.0.0/15), 4-bit payloads over a 20 Mbit/s
    link: every sync is a group of both, and both end with the same global parameters."""
    pytest.importorskip("hivemind")
    config = str(ROOT / "configs/quickstart.yaml")
    overrides = [
        *TINY_WAN,
        "run.name=swarm",
        f"run.output_dir={tmp_path}",
        "compression.scheme=statistical",
        "compression.bits=4",
        "backend.hivemind.target_group_size=2",
    ]
    with Testbed(2, 20) as testbed:
        run = train_on_testbed(
            testbed, config, overrides, tmp_path / "logs", backend="hivemind", timeout_s=240
        )
    assert run.ok, f"exit codes {run.returncodes}; " + Path(run.logs[1]).read_text()[-2000:]
    finals = []
    for peer in (0, 1):
        run_dir = tmp_path / f"swarm-peer{peer}"
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r.get("group_size") for r in records if r["kind"] == "sync"] == [2, 2]
        finals.append(json.loads((run_dir / "summary.json").read_text())["final_val_loss"])
    assert finals[0] == finals[1]


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@needs_netns
# Time (~25 s): a kill, the lighthouse's heartbeat timeout and a live rejoin over rate-limited links.
def test_torchft_workers_on_separate_hosts_survive_a_death_and_rejoin_live(tmp_path):
    """Three torchft workers on hosts of their own, the lighthouse on host 0. Every address a worker
    advertises (its manager, store and state server: backend.torchft.hostname) is its host's, so the
    quorum's gloo group and a rejoining worker's state download cross the links. Worker 2 is SIGKILLed
    after its second sync and started again on its host: it adopts the others' state over the link and ends
    with their global parameters, bit for bit."""
    pytest.importorskip("torchft")
    from test_helpers import assert_same_global_params, sync_records

    lighthouse_bin = Path(sys.executable).parent / "torchft_lighthouse"
    config = str(ROOT / "configs/quickstart.yaml")
    common = [
        "model.preset=nano",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.seq_len=32",
        "workers=3",
        "train.batch_tokens=384",
        "train.total_tokens=9216",  # 24 steps: 8 syncs
        "train.eval_every=0",
        "train.eval_tokens=512",
        "sync.every=3",
        "logging.progress=off",
        "backend.kind=torchft",
        f"run.output_dir={tmp_path}",
    ]
    with Testbed(3, 200) as testbed:
        hub = testbed.hosts[0].address
        lighthouse = f"http://{hub}:29510"
        testbed.popen(
            0,
            [str(lighthouse_bin), "--min_replicas", "1", "--join_timeout_ms", "60000"]
            + ["--heartbeat_timeout_ms", "15000", "--bind", f"{hub}:29510"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/status', timeout=2)"
        up = [sys.executable, "-c", probe, lighthouse]
        _wait_for(
            lambda: subprocess.run(testbed.command(0, up), capture_output=True).returncode == 0, 30, "it"
        )

        def start(host: int, name: str) -> subprocess.Popen:
            overrides = [
                f"backend.torchft.lighthouse={lighthouse}",
                f"backend.torchft.replica_id={host}",
                f"backend.torchft.hostname={testbed.hosts[host].address}",
                f"run.name={name}",
            ]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            with open(tmp_path / f"{name}.log", "w") as log:
                return testbed.start_muloco(host, ["train", config, *common, *overrides], env, log)

        workers = [start(host, f"ft-worker{host}") for host in range(3)]
        victim = tmp_path / "ft-worker2"
        _wait_for(
            lambda: (victim / "metrics.jsonl").exists() and len(sync_records(victim)) >= 2, 120, "2 syncs"
        )
        os.killpg(workers[2].pid, signal.SIGKILL)
        replacement = start(2, "back")
        codes = [p.wait(timeout=240) for p in (workers[0], workers[1], replacement)]
    logs = {name: (tmp_path / f"{name}.log").read_text()[-2000:] for name in ("ft-worker0", "back")}
    assert codes == [0, 0, 0], logs
    records = sync_records(tmp_path / "back")
    assert records[0]["healed"] and records[0]["quorum_size"] == 3, records[0]
    assert "adopted the quorum's state live" in logs["back"]
    assert_same_global_params(tmp_path / "ft-worker0", tmp_path / "ft-worker1", tmp_path / "back")
