"""muloco on a testbed: `muloco train` on every host of a `Testbed` (network.py), one worker each, wired as
the backend needs (torch: torchrun's variables; hivemind: each peer dials the earlier ones; torchft: a
lighthouse on host 0), with the bytes each host's link carried during the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from muloco.net.launch import free_port, wait_for_maddrs
from muloco.testbed.network import CMD_TIMEOUT_S, Testbed


@dataclass
class TestbedRun:
    __test__ = False  # not a pytest test class

    returncodes: list[int | None]
    wall_s: float  # first process started -> last one ended
    wire_sent: list[int]  # bytes each host sent over its link during the run (headers included)
    wire_received: list[int]
    logs: list[str]  # each host's output file

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)


def train_on_testbed(
    testbed: Testbed,
    config: str,
    overrides: Sequence[str],
    log_dir: str | os.PathLike,
    backend: str = "torch",
    timeout_s: float = 1800.0,
    threads_per_worker: int = 1,
    restart_after_syncs: int | None = None,
) -> TestbedRun:
    """`muloco train` on every host of `testbed`, one worker each. torch: wired as torchrun would, rank 0's
    host the rendezvous (gloo over eth0). hivemind: host 0 starts the swarm on its address, each other host
    joins with the multiaddrs of every host before it; each peer a run of its own
    (`run.name=<name>-peer<i>`). torchft: a lighthouse on host 0, each worker a run of its own
    (`run.name=<name>-worker<i>`) that advertises its host's address. Processes still running after
    `timeout_s` are ended and count as failed (returncode None).

    restart_after_syncs (torchft): the last host's worker is SIGKILLed once it logged that many syncs and
    started again on its host (`run.name=<name>-back`), where it rejoins the others live; its returncode is
    the restarted process's."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(testbed.hosts)
    port = free_port()  # any port: each namespace has its own port space
    base_env = {
        **os.environ,
        "WORLD_SIZE": str(n),
        "MASTER_ADDR": testbed.hosts[0].address,
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": testbed.hosts[0].interface,  # gloo would pick the hostname's address
        "OMP_NUM_THREADS": str(threads_per_worker),
        "PYTHONUNBUFFERED": "1",
    }
    before = [testbed.interface_bytes(h.index) for h in testbed.hosts]
    procs, logs = [], []
    started = time.perf_counter()
    run_name = next((o.split("=", 1)[1] for o in overrides if o.startswith("run.name=")), "run")
    maddrs: list[str] = []
    lighthouse = _start_lighthouse(testbed, log_dir, overrides) if backend == "torchft" else ""
    for host in testbed.hosts:
        extra = [f"backend.kind={backend}", f"train.threads={threads_per_worker}"]
        if backend == "torchft":
            extra += [
                f"run.name={run_name}-worker{host.index}",
                f"backend.torchft.lighthouse={lighthouse}",
                f"backend.torchft.replica_id={host.index}",
                f"backend.torchft.hostname={host.address}",
            ]
        if backend == "hivemind":
            extra += [
                f"run.name={run_name}-peer{host.index}",
                f"backend.hivemind.host_maddrs=['/ip4/{host.address}/tcp/0']",
                f"backend.hivemind.wait_for_peers={n}",
                f"backend.hivemind.bandwidth_mbps={testbed.rate_mbit}",
            ]
            if host.index > 0:
                # Every earlier peer, not only the first: peers that knew only host 0 could not dial each
                # other here (the p2p daemon: "routing: not found"), so groups fell apart. Dialling the
                # peers they were given is enough; the later ones then dial them.
                maddrs += _swarm_maddrs(procs[-1], logs[-1])
                extra.append(f"backend.hivemind.initial_peers={maddrs}")
        env = {**base_env, "RANK": str(host.index), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        if backend == "torchft":
            env["GLOO_SOCKET_IFNAME"] = host.interface  # its own host's link, not host 0's
        log_path = log_dir / f"host{host.index}.log"
        cmd = ["train", config, *overrides, *extra]
        with open(log_path, "w") as out:
            procs.append(testbed.start_muloco(host.index, cmd, env, out))
        logs.append(str(log_path))
    deadline = started + timeout_s
    if restart_after_syncs is not None:
        victim = n - 1
        run_dir = _output_dir(overrides) / f"{run_name}-worker{victim}"
        while _sync_count(run_dir) < restart_after_syncs and procs[victim].poll() is None:
            if time.perf_counter() > deadline:
                break
            time.sleep(0.05)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait(timeout=CMD_TIMEOUT_S)
        back = [*cmd, f"run.name={run_name}-back"]  # the victim's command (cmd: the last host's), renamed
        logs[victim] = str(log_dir / f"host{victim}-back.log")
        env = {**base_env, "RANK": str(victim), "GLOO_SOCKET_IFNAME": testbed.hosts[victim].interface}
        with open(logs[victim], "w") as out:
            procs[victim] = testbed.start_muloco(victim, back, env, out)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            break
    wall = time.perf_counter() - started
    codes = [proc.poll() for proc in procs]
    if any(code is None for code in codes):
        testbed.teardown_processes()
    after = [testbed.interface_bytes(h.index) for h in testbed.hosts]
    return TestbedRun(
        returncodes=codes,
        wall_s=wall,
        wire_sent=[a[0] - b[0] for a, b in zip(after, before, strict=True)],
        wire_received=[a[1] - b[1] for a, b in zip(after, before, strict=True)],
        logs=logs,
    )


def _start_lighthouse(testbed: Testbed, log_dir: Path, overrides: Sequence[str]) -> str:
    """torchft's lighthouse on host 0 with the run's backend.torchft settings; its URL once it answers."""
    from muloco.config import load_config

    section = load_config(None, [o for o in overrides if o.startswith("backend.torchft.")]).backend.torchft
    address = f"{testbed.hosts[0].address}:29510"  # any port: host 0's namespace has its own port space
    cmd = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", address]
    cmd += ["--min_replicas", str(section.min_replicas)]
    cmd += ["--join_timeout_ms", str(int(section.join_timeout_s * 1000))]
    cmd += ["--heartbeat_timeout_ms", str(int(section.heartbeat_timeout_s * 1000))]
    with open(log_dir / "lighthouse.log", "w") as out:
        testbed.popen(0, cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"})
    url = f"http://{address}"
    probe = [
        sys.executable,
        "-c",
        "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)",
    ]
    deadline = time.monotonic() + CMD_TIMEOUT_S
    while subprocess.run(testbed.command(0, [*probe, f"{url}/status"]), capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError(f"torchft's lighthouse did not answer on host 0; see {log_dir}/lighthouse.log")
        time.sleep(0.2)
    return url


def _output_dir(overrides: Sequence[str]) -> Path:
    found = [o.split("=", 1)[1] for o in overrides if o.startswith("run.output_dir=")]
    return Path(found[-1] if found else "runs")


def _sync_count(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"kind": "sync"')
    except FileNotFoundError:
        return 0


def _swarm_maddrs(proc: subprocess.Popen, log_path: str) -> list[str]:
    """The multiaddrs a peer logs once its swarm is up (RuntimeError if it dies or takes too long)."""
    found = wait_for_maddrs(proc, lambda: Path(log_path).read_text().splitlines())
    if not found:
        raise RuntimeError(f"a hivemind peer did not start its swarm; see {log_path}")
    return found
