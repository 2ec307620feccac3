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
has no bridge: a user-space delay line (delay_line.py) forwards every frame between its ports
after `delay_ms`, so hosts see that one-way delay and twice it as their round trip, the rate still set by
tbf. Without it links have the veth's sub-millisecond round trip.

A `Testbed` is a context manager: everything it made (namespaces, links, the processes it started) is torn
down on leaving, whether the body returned, raised or was interrupted (Ctrl+C, SIGTERM). Namespaces left
behind by a testbed whose process was SIGKILLed are removed by the next testbed that starts. Needs root and
iproute2 (`ip`, `tc`): `missing_requirements()` says what is missing, for a skip message. Runs of muloco
over a testbed's hosts: train.py.
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from muloco.errors import UserError
from muloco.net import preloaded
from muloco.net.launch import end_processes
from muloco.net.parent_death import sigterm_when_parent_dies
from muloco.testbed.cpu_quota import CpuQuotas, missing_cpu_controller, remove_stale_groups
from muloco.testbed.delay_line import READY

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

    def __init__(
        self, hosts: int, rate_mbit: float, delay_ms: float = 0.0, cpus: Sequence[float] | None = None
    ) -> None:
        """cpus: each host's CPU quota in cores (cpu_quota.py), None: no quota."""
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
        if cpus is not None and len(cpus) != hosts:
            raise UserError(f"testbed cpus lists {len(cpus)} quotas for {hosts} hosts: give one per host")
        self.quotas = CpuQuotas(self.name, list(cpus)) if cpus is not None else None
        self.processes: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._previous_sigterm = None

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        reason = missing_requirements() or (missing_cpu_controller() if self.quotas else None)
        if reason:
            raise UserError(f"cannot make a network testbed: {reason}")
        remove_stale_namespaces()
        remove_stale_groups(PREFIX, _alive)
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
        if self.quotas is not None:
            self.quotas.create()
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
        cmd = [sys.executable, "-m", "muloco.testbed.delay_line", "--delay-ms", str(self.delay_ms), *ports]
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
        if self.quotas is not None:
            self.quotas.remove()
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
        self._confine(host, proc.pid)
        return proc

    def _confine(self, host: int, pid: int) -> None:
        """Under the host's CPU quota, if the testbed has quotas (before the process starts children)."""
        if self.quotas is not None:
            self.quotas.confine(host, pid)

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
        self._confine(host, proc.pid)
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
