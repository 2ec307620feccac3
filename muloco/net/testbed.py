"""An emulated wide-area network on one Linux machine: one network namespace per host, rate-limited links.

    host 0 (netns) eth0 ──veth── p0 ┐
    host 1 (netns) eth0 ──veth── p1 ├─ bridge br0 in the hub netns
    ...                             ┘

Each host's link is limited in both directions by a token-bucket filter (`tc qdisc ... tbf`): on the host's
eth0 (its upload) and on the hub's end of the veth (its download), so every host has a symmetric access link
of `rate_mbit`, as a machine on a WAN uplink has. Addresses come from 198.18.0.0/15 (RFC 2544's range for
benchmarking), so nothing here can reach, or be confused with, a real network; no interface is created in
the machine's own namespace.

Latency: the kernel's `netem` qdisc is not available here and tbf only queues. With `delay_ms` > 0 the hub
has no bridge: a user-space delay line (muloco/net/delay_line.py) forwards every frame between its ports
after `delay_ms`, so hosts see that one-way delay and twice it as their round trip, the rate still set by
tbf. Without it links have the veth's sub-millisecond round trip.

A `Testbed` is a context manager: everything it made (namespaces, links, the processes it started) is torn
down on leaving, whether the body returned, raised or was interrupted (Ctrl+C, SIGTERM). Namespaces left
behind by a testbed whose process was SIGKILLed are removed by the next testbed that starts. Needs root and
iproute2 (`ip`, `tc`): `missing_requirements()` says what is missing, for a skip message.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from muloco.errors import UserError
from muloco.net import preloaded
from muloco.net.delay_line import READY
from muloco.net.launch import end_processes, free_port, sigterm_when_parent_dies, wait_for_maddrs

PREFIX = "mlc-"  # every namespace a testbed makes: mlc-<pid>-<serial>-<host|hub>
SUBNET = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15 (RFC 2544 benchmarking)
CMD_TIMEOUT_S = 20.0
_serials = itertools.count(1)  # testbeds made by this process


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str  # eth0's address inside the namespace
    interface: str = "eth0"


def missing_requirements() -> str | None:
    """Why a testbed cannot be made here (None when it can): not Linux, not root, no ip/tc, or namespaces
    refused (a container without CAP_SYS_ADMIN)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or skip the WAN tests)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT_S)
    return None


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf's settings for a link of `rate_mbit`. burst: 2 ms at the rate, at least 64 KB (a whole GSO
    segment, so a bucket never refuses a packet outright); latency: how long a packet may queue before it
    is dropped; 200 ms keeps TCP at the rate without drops from a full queue at these rates."""
    rate_bits = rate_mbit * 1e6
    burst = max(64 * 1024, int(rate_bits / 8 * 0.002))
    return ["rate", f"{rate_bits:.0f}bit", "burst", str(burst), "latency", "200ms"]


def tcp_buffer_sysctls(rate_mbit: float, delay_ms: float) -> list[str]:
    """TCP's largest send and receive buffers: twice the bandwidth-delay product (round trip 2 x delay),
    at least 4 MiB. The defaults cap the send buffer at 4 MiB, which at a 50 ms round trip holds a window of
    ~650 Mbit/s: measured 435 Mbit/s at 1 Gbit/s before, 800 after (docs/wan.md)."""
    largest = max(4 << 20, int(2 * rate_mbit * 1e6 / 8 * 2 * delay_ms / 1000))
    return [f"net.ipv4.tcp_wmem=4096 16384 {largest}", f"net.ipv4.tcp_rmem=4096 131072 {largest}"]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of testbeds whose process no longer exists (one that was SIGKILLed)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    removed = []
    for name in (line.split(maxsplit=1)[0] for line in listed.stdout.splitlines() if line.strip()):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=CMD_TIMEOUT_S)
            removed.append(name)
    return removed


class Testbed:
    """`hosts` namespaces on one hub, each host's link limited to `rate_mbit` both ways and, with
    `delay_ms`, that one-way delay between any two hosts."""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, rate_mbit: float, delay_ms: float = 0.0) -> None:
        if hosts < 1 or hosts > 250:
            raise UserError(f"testbed hosts must be 1..250, got {hosts}")
        if rate_mbit <= 0:
            raise UserError(f"testbed rate_mbit must be > 0, got {rate_mbit}")
        if delay_ms < 0:
            raise UserError(f"testbed delay_ms must be >= 0, got {delay_ms}")
        self.name = f"{PREFIX}{os.getpid()}-{next(_serials)}"
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        self.hub = f"{self.name}-hub"
        addresses = list(SUBNET.hosts())
        self.hosts = [Host(i, f"{self.name}-h{i}", str(addresses[i])) for i in range(hosts)]
        self.processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._previous_sigterm = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        reason = missing_requirements()
        if reason:
            raise UserError(f"cannot make a network testbed: {reason}")
        remove_stale_namespaces()
        self._raise_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _raise_on_sigterm(self) -> None:
        """SIGTERM unwinds like Ctrl+C, so `with Testbed(...)` tears down on both (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        self._previous_sigterm = signal.signal(signal.SIGTERM, handler)

    def _build(self) -> None:
        tbf = tbf_args(self.rate_mbit)
        _run("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        if not self.delay_ms:
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host in self.hosts:
            _run("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
            port = f"p{host.index}"
            eth, address = host.interface, f"{host.address}/{SUBNET.prefixlen}"
            # The veth pair is made inside the hub, its host end moved straight into the host's namespace.
            _run(
                "ip",
                "-n",
                self.hub,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                eth,
                "netns",
                host.netns,
            )
            bridged = () if self.delay_ms else ("master", "br0")  # with a delay, the delay line forwards
            _run("ip", "-n", self.hub, "link", "set", port, *bridged, "up")
            _run("ip", "-n", host.netns, "addr", "add", address, "dev", eth)
            _run("ip", "-n", host.netns, "link", "set", eth, "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            # Upload: the host's egress; download: the hub's egress towards the host.
            _run("ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", eth, "root", "tbf", *tbf)
            _run("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", port, "root", "tbf", *tbf)
        if self.delay_ms:
            for host in self.hosts:  # TCP buffers that hold the link's bandwidth-delay product, as tuned
                buffers = tcp_buffer_sysctls(self.rate_mbit, self.delay_ms)  # WAN hosts have them
                _run("ip", "netns", "exec", host.netns, "sysctl", "-q", "-w", *buffers)
            self._start_delay_line()

    def _start_delay_line(self) -> None:
        """The hub's switch in user space (delay_line.py), up before any host sends."""
        ports = [f"p{host.index}" for host in self.hosts]
        cmd = [sys.executable, "-m", "muloco.net.delay_line", "--delay-ms", str(self.delay_ms), *ports]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, *cmd],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=sigterm_when_parent_dies,
        )
        self.processes.append(proc)
        ready = [None]
        reader = threading.Thread(target=lambda: ready.__setitem__(0, proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(CMD_TIMEOUT_S)
        if not (ready[0] or "").startswith(READY):
            raise RuntimeError(f"the hub's delay line did not start (exit code {proc.poll()})")

    def teardown(self) -> None:
        """End every process this testbed started, delete its namespaces (which deletes their links). Safe
        to call twice."""
        self.teardown_processes()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=CMD_TIMEOUT_S)
        self._made.clear()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def teardown_processes(self) -> None:
        """SIGTERM every process this testbed started (their whole process group), SIGKILL after 10 s."""
        end_processes(self.processes, whole_group=True)

    # -- using it -------------------------------------------------------------------------------------
    def command(self, host: int, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].netns, *cmd]

    def popen(self, host: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside host `host`'s namespace, in its own process group (torn down with the
        testbed; asked to die with this process if it is killed)."""
        proc = subprocess.Popen(
            self.command(host, cmd), start_new_session=True, preexec_fn=sigterm_when_parent_dies, **kwargs
        )
        self.processes.append(proc)
        return proc

    def start_muloco(
        self, host: int, args: Sequence[str], env: dict[str, str], log: IO
    ) -> preloaded.PreloadedProcess | subprocess.Popen:
        """`python -m muloco ARGS` on host `host`, output to `log`, forked from the preloaded server into the
        host's namespace (muloco/net/preloaded.py: it spares each process torch's import, ~4 s of CPU); in
        its own process group, torn down with the testbed, ended if this process dies."""
        proc = preloaded.start_muloco(
            list(args),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            new_session=True,
            die_with_parent=True,
            netns=self.hosts[host].netns,
        )
        self.processes.append(proc)
        return proc

    def run(self, host: int, cmd: Sequence[str], timeout: float = CMD_TIMEOUT_S) -> str:
        """Run `cmd` in host `host`'s namespace to completion; its stdout (RuntimeError if it fails)."""
        done = subprocess.run(self.command(host, cmd), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` on host {host} failed: {done.stderr.strip()}")
        return done.stdout

    def interface_bytes(self, host: int) -> tuple[int, int]:
        """(sent, received) bytes on the host's link so far, headers included: what crossed the wire."""
        stats = f"/sys/class/net/{self.hosts[host].interface}/statistics"
        out = self.run(host, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"])
        tx, rx = out.split()
        return int(tx), int(rx)

    def namespaces(self) -> list[str]:
        return list(self._made)


# -- muloco on a testbed: one worker per host ---------------------------------------------------------
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
