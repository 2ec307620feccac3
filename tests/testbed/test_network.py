"""The emulated WAN (muloco.testbed.network, its delay line): namespaces, addresses, rate limits, delay,
teardown.

Needs root and iproute2; skipped with the reason where either is missing. Every namespace is checked gone
after each test: on success, on an exception in the body, on Ctrl+C/SIGTERM of the process holding the
testbed, and (by the next testbed) after a SIGKILL.
"""

import ipaddress
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from muloco.errors import UserError
from muloco.testbed.cpu_quota import missing_cpu_controller
from muloco.testbed.network import PREFIX, Testbed, missing_requirements, remove_stale_namespaces, tbf_args
from muloco.testbed.probe import goodput_mbit, median_round_trip_ms

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_RANGE = ipaddress.ip_network("198.18.0.0/15")
REASON = missing_requirements()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network testbed here: {REASON}")


def namespaces(prefix: str = PREFIX) -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.split() and line.startswith(prefix)}


def test_tbf_burst_covers_a_gso_segment_and_2ms_at_the_rate():
    assert tbf_args(100) == ["rate", "100000000bit", "burst", "65536", "latency", "200ms"]
    assert tbf_args(1000)[3] == "250000"  # 2 ms of 1 Gbit/s


@pytest.mark.parametrize("hosts, rate", [(0, 10), (251, 10), (2, 0), (2, -5)])
def test_bad_testbed_sizes_are_user_errors(hosts, rate):
    with pytest.raises(UserError, match="testbed"):
        Testbed(hosts, rate)


@needs_netns
def test_hosts_have_benchmark_addresses_rate_limits_and_reach_each_other():
    with Testbed(3, 40) as testbed:
        made = set(testbed.namespaces())
        assert made <= namespaces() and len(made) == 4  # 3 hosts + the hub
        for host in testbed.hosts:
            assert ipaddress.ip_address(host.address) in BENCHMARK_RANGE
            addrs = testbed.run(host.index, ["ip", "-4", "-o", "addr", "show"])
            # Only loopback and the benchmark address: nothing routes out of the namespace.
            assert f"inet {host.address}/24" in addrs and addrs.count("inet ") == 2
            assert "rate 40Mbit" in testbed.run(host.index, ["tc", "qdisc", "show", "dev", "eth0"])
            routes = testbed.run(host.index, ["ip", "route"]).strip().splitlines()
            assert routes == [f"198.18.0.0/24 dev eth0 proto kernel scope link src {host.address}"]
        # host 2 reaches host 0 over TCP
        server = testbed.popen(0, [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
        reply = testbed.run(2, [sys.executable, "-c", ECHO_CLIENT.format(address=testbed.hosts[0].address)])
        assert reply.strip() == "pong"
        server.wait(timeout=10)
    assert not made & namespaces()


ECHO_SERVER = textwrap.dedent("""
    import socket
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5001)); s.listen(1); s.settimeout(15)
    c, _ = s.accept(); c.sendall(b"pong"); c.close()
""")
ECHO_CLIENT = textwrap.dedent("""
    import socket, time
    for _ in range(50):
        try:
            c = socket.create_connection(("{address}", 5001), timeout=5); break
        except OSError:
            time.sleep(0.1)
    print(c.recv(4).decode())
""")


@needs_netns
def test_the_rate_limit_holds_both_ways():
    """1.5 MB at 8 Mbit/s takes >= 1.5 s; the same on the host's download direction."""
    payload = 1_500_000
    send = (
        "import socket; s = socket.create_connection(('{address}', 5001), timeout=20); "
        f"s.sendall(b'x' * {payload}); s.close()"
    )
    recv = textwrap.dedent(f"""
        import socket, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 5001)); s.listen(1); s.settimeout(20)
        c, _ = s.accept(); n = 0; t0 = time.perf_counter()
        while n < {payload}:
            b = c.recv(1 << 20)
            if not b: break
            n += len(b)
        print(n, time.perf_counter() - t0)
    """)
    with Testbed(2, 8) as testbed:
        for receiver, sender in ((0, 1), (1, 0)):
            server = testbed.popen(receiver, [sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True)
            time.sleep(0.3)
            address = testbed.hosts[receiver].address
            testbed.run(sender, [sys.executable, "-c", send.format(address=address)], timeout=30)
            n, seconds = server.communicate(timeout=30)[0].split()
            assert int(n) == payload
            # 1.5 MB at 8 Mbit/s = 1.5 s; the bucket's 64 KB burst and the socket buffers shave a little
            assert 1.2 < float(seconds) < 4.0


@needs_netns
def test_the_delay_line_adds_its_delay_both_ways_and_carries_the_rate():
    """25 ms one way through the hub's user-space delay line: a 50 ms round trip (the veth's own is
    ~0.1 ms), and a bulk transfer at the link's rate with the delay in TCP's window."""
    with Testbed(3, 50, delay_ms=25) as testbed:
        made = set(testbed.namespaces())
        assert "br0" not in hub_links(testbed)  # the delay line forwards, not a bridge
        for client, server in ((0, 1), (2, 0)):  # any pair: one hub crossing each way
            round_trip = median_round_trip_ms(testbed, client, server)
            # Measured 51.0 ms on a quiet machine, 51.4-52.7 ms beside a full test suite; the upper bound
            # leaves room for a loaded one.
            assert 50.0 <= round_trip < 70.0, round_trip
        # 6 MB at 50 Mbit/s: 1.0 s at TCP's 95.7% of the line; slow start over 50 ms round trips costs
        # some (measured 39.9 Mbit/s beside a full test suite).
        assert 25.0 < goodput_mbit(testbed, 1, 2, 6_000_000) < 50.0
        wmem = testbed.run(0, ["sysctl", "-n", "net.ipv4.tcp_wmem"]).split()
        assert int(wmem[-1]) == 4 << 20  # twice 50 Mbit/s x 50 ms is under the 4 MiB floor
    assert not made & namespaces()


@needs_netns
def test_a_process_that_enters_a_hosts_namespace_has_that_hosts_network():
    """What a run forked from the preloaded server does on a testbed host (Testbed.start_muloco): it joins
    the host's network namespace, so it sees the host's eth0 and address, not this machine's interfaces."""
    enter = textwrap.dedent(
        """
        import socket, subprocess, sys
        from muloco.net.preload_server import _enter_network_namespace
        _enter_network_namespace(sys.argv[1])
        print(sorted(name for _, name in socket.if_nameindex()))
        print(subprocess.run(["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True).stdout.decode())
        """
    )
    with Testbed(2, 100) as testbed:
        host = testbed.hosts[1]
        done = subprocess.run(
            [sys.executable, "-c", enter, host.netns], capture_output=True, text=True, timeout=30, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr
        interfaces, addresses = done.stdout.split("\n", 1)
        assert interfaces == "['eth0', 'lo']"
        assert f"inet {host.address}/" in addresses


def hub_links(testbed: Testbed) -> str:
    return subprocess.run(
        ["ip", "-n", testbed.hub, "link", "show"], capture_output=True, text=True, timeout=20
    ).stdout


def test_a_negative_delay_is_a_user_error():
    with pytest.raises(UserError, match="delay_ms must be >= 0"):
        Testbed(2, 10, delay_ms=-1)


@needs_netns
def test_teardown_after_an_exception_in_the_body():
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(2, 10) as testbed:
            made = set(testbed.namespaces())
            sleeper = testbed.popen(1, ["sleep", "60"])
            raise RuntimeError("boom")
    assert not made & namespaces()
    assert sleeper.poll() is not None  # the process started in the namespace ended too


HOLDER = textwrap.dedent("""
    import faulthandler, signal, sys, time
    from muloco.testbed.network import Testbed
    faulthandler.register(signal.SIGUSR1)  # where it is stuck, if a test asks (wait_or_explain)
    # Ctrl+C as a terminal's process gets it: Python leaves SIGINT ignored when its parent did, and a
    # non-interactive shell starts a background job (`cmd &`) with SIGINT ignored (POSIX), which the whole
    # suite then inherits (CI saw the holder sleep on through SIGINT); this test is about Ctrl+C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with Testbed(2, 10) as testbed:
        sleeper = testbed.popen(0, ["sleep", "120"])
        print(sleeper.pid, *testbed.namespaces(), flush=True)
        time.sleep(120)
""")


def start_holder() -> tuple[subprocess.Popen, int, set[str]]:
    """A process holding a testbed with a process in it; its pid and the namespaces it made."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    first, *made = holder.stdout.readline().split()
    return holder, int(first), set(made)


def wait_or_explain(holder: subprocess.Popen, timeout: float) -> None:
    """The holder's exit within `timeout`; else fail with where its threads were (its stderr)."""
    try:
        holder.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        holder.send_signal(signal.SIGUSR1)
        time.sleep(1)
        holder.kill()
        stacks = holder.communicate(timeout=10)[1]
        pytest.fail(f"the testbed's holder did not exit within {timeout:.0f} s; its stacks:\n{stacks}")


def ended(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


@needs_netns
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_teardown_on_ctrl_c_and_sigterm(signum):
    holder, sleeper, made = start_holder()
    try:
        assert len(made) == 3 and made <= namespaces()
        holder.send_signal(signum)
        wait_or_explain(holder, 30)
        assert not made & namespaces()
        assert ended(sleeper)
    finally:
        holder.kill()
        holder.wait()


@needs_netns
def test_namespaces_of_a_killed_testbed_are_removed_by_the_next():
    holder, sleeper, made = start_holder()
    try:
        holder.kill()  # SIGKILL: no teardown runs
        holder.wait(timeout=10)
        assert ended(sleeper)  # asked to die with its parent
        assert made <= namespaces()
        assert made <= set(remove_stale_namespaces())
        assert not made & namespaces()
    finally:
        holder.kill()
        holder.wait()
        for name in made & namespaces():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


BUSY = (
    "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"
    "print(time.process_time())"
)


@needs_netns
@pytest.mark.skipif(missing_cpu_controller() is not None, reason=f"{missing_cpu_controller()}")
def test_a_hosts_cpu_quota_caps_its_processes_and_goes_with_the_testbed():
    """Host 0 at a quarter of a core: a busy loop there gets at most that share of its wall time (the cap
    holds on a busy machine too; the uncapped share depends on the load, so it is not asserted, and on a
    machine so busy that host 1 got no more than half a core, host 0 may never reach its quota)."""
    wall = 2.0
    with Testbed(2, rate_mbit=100, cpus=[0.25, 1.0]) as testbed:
        groups = list(testbed.quotas.groups)
        assert all(g.exists() for g in groups)
        assert (groups[0] / "cpu.cfs_quota_us").read_text().strip() == "25000"
        procs = [
            testbed.popen(h, [sys.executable, "-c", BUSY.format(s=wall)], stdout=subprocess.PIPE, text=True)
            for h in (0, 1)
        ]
        cpu = [float(p.communicate(timeout=60)[0]) for p in procs]
        assert cpu[0] <= 0.25 * wall * 1.2 + 0.05, cpu
        if cpu[1] > 0.5 * wall:  # the machine had room beyond host 0's quota: the cap is what held it
            assert testbed.quotas.throttled_s(0) > 0, cpu
    assert not any(g.exists() for g in groups)
    with pytest.raises(UserError, match="testbed cpus lists 1 quotas for 2 hosts"):
        Testbed(2, rate_mbit=100, cpus=[1.0])
