"""What a testbed's links carry, measured between two of its hosts: the round trip of a 1-byte TCP message
and the goodput of a bulk TCP transfer (tests/testbed/test_network.py,
experiments/benchmarks/bench_delay_line.py); and among all of them, the time of gloo's collectives
(experiments/wan/probe_collectives.py, experiments/benchmarks/bench_control_plane.py). All run as small
Python programs inside the hosts' namespaces."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

from muloco.net.launch import free_port
from muloco.net.parent_death import sigterm_when_parent_dies
from muloco.testbed.network import Testbed

PORT = 5003

_SERVER = textwrap.dedent("""
    import socket, sys, time
    mode, size = sys.argv[1], int(sys.argv[2])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", {port})); s.listen(1); s.settimeout(60)
    print("listening", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "echo":
        while (b := c.recv(64)):
            c.sendall(b)
    else:
        n, first = 0, None
        while n < size and (b := c.recv(1 << 20)):
            first = first or time.perf_counter()
            n += len(b)
        print(n, time.perf_counter() - first, flush=True)
""").format(port=PORT)

_CLIENT = textwrap.dedent("""
    import socket, sys, time
    address, mode, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = socket.create_connection((address, {port}), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if mode == "echo":
        out = []
        for _ in range(size):
            t0 = time.perf_counter(); c.sendall(b"x"); c.recv(64); out.append(time.perf_counter() - t0)
        print(" ".join(repr(x) for x in out))
    else:
        c.sendall(b"x" * size); c.shutdown(socket.SHUT_WR); c.recv(1)
""").format(port=PORT)


def _serve(testbed: Testbed, host: int, mode: str, size: int) -> subprocess.Popen:
    server = testbed.popen(
        host, [sys.executable, "-c", _SERVER, mode, str(size)], stdout=subprocess.PIPE, text=True
    )
    if server.stdout.readline().strip() != "listening":
        raise RuntimeError(f"probe server on host {host} did not start (exit code {server.poll()})")
    return server


def round_trips_ms(testbed: Testbed, client: int, server: int, count: int = 21) -> list[float]:
    """`count` round trips of a 1-byte message on one TCP connection (Nagle off), in ms."""
    proc = _serve(testbed, server, "echo", 0)
    address = testbed.hosts[server].address
    out = testbed.run(client, [sys.executable, "-c", _CLIENT, address, "echo", str(count)], timeout=60)
    proc.wait(timeout=30)
    return [float(x) * 1000.0 for x in out.split()]


def median_round_trip_ms(testbed: Testbed, client: int, server: int, count: int = 21) -> float:
    """The median round trip, the first (the connection's warm-up) left out."""
    return statistics.median(round_trips_ms(testbed, client, server, count)[1:])


def goodput_mbit(testbed: Testbed, sender: int, receiver: int, size_bytes: int) -> float:
    """Payload Mbit/s of one TCP transfer of `size_bytes`, timed at the receiver from its first byte to its
    last (so the connection's set-up is left out; TCP's slow start is in)."""
    proc = _serve(testbed, receiver, "bulk", size_bytes)
    address = testbed.hosts[receiver].address
    started = time.perf_counter()
    testbed.run(sender, [sys.executable, "-c", _CLIENT, address, "bulk", str(size_bytes)], timeout=300)
    out, _ = proc.communicate(timeout=max(30.0, 2 * (time.perf_counter() - started)))
    received, seconds = out.split()
    if int(received) != size_bytes:
        raise RuntimeError(f"probe: {received} of {size_bytes} bytes arrived")
    return size_bytes * 8 / float(seconds) / 1e6


# One rank: each op 12 times after a barrier and a pause (a sync comes after a round of compute, its
# connections idle), the median of the last 10, printed by rank 0.
_COLLECTIVES = """
import json, statistics, sys, time, torch, torch.distributed as dist
rank, world, master, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
pause, ops = float(sys.argv[5]), json.loads(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
out = {}
def reduce_scatter(part, mean):
    # As muloco/sync/reduce.py runs it: the parts to their owners (all-to-all), the owners' means gathered.
    send = torch.zeros(part * world, dtype=torch.uint8)
    dist.all_to_all_single(torch.empty_like(send), send, [part] * world, [part] * world)
    means = torch.zeros(mean, dtype=torch.uint8)
    dist.all_gather([torch.empty_like(means) for _ in range(world)], means)
for name, kind, size, *mean in ops:
    if kind in ("all_reduce", "all_reduce_bf16"):
        dtype = torch.bfloat16 if kind == "all_reduce_bf16" else torch.float32
        x = torch.zeros(max(1, size // dtype.itemsize), dtype=dtype)
        op = lambda x=x: dist.all_reduce(x)
    elif kind == "reduce_scatter":
        op = lambda p=max(1, size // world), q=max(1, mean[0] // world): reduce_scatter(p, q)
    else:
        x = torch.zeros(size, dtype=torch.uint8)
        op = lambda x=x: dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
    times = []
    for _ in range(12):
        dist.barrier()
        time.sleep(pause)
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    out[name] = statistics.median(times[2:])
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def time_collectives(testbed: Testbed | None, ops: list[tuple], pause_s: float, workers: int = 4) -> dict:
    """Median seconds of each (name, all_reduce | all_reduce_bf16 | all_gather, bytes per rank) or (name,
    reduce_scatter, message bytes, owners' mean bytes) over every host (gloo); testbed None: `workers`
    processes on this machine's loopback, as a run with no link has them."""
    port, procs = str(free_port()), []
    ranks = len(testbed.hosts) if testbed is not None else workers
    master = testbed.hosts[0].address if testbed is not None else "127.0.0.1"
    for rank in range(ranks):
        cmd = [sys.executable, "-c", _COLLECTIVES, str(rank), str(ranks), master, port, str(pause_s)]
        cmd.append(json.dumps(ops))
        interface = testbed.hosts[rank].interface if testbed is not None else "lo"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": interface}
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
        if testbed is not None:
            procs.append(testbed.popen(rank, cmd, **pipes))
        else:
            procs.append(
                subprocess.Popen(cmd, start_new_session=True, preexec_fn=sigterm_when_parent_dies, **pipes)
            )
    try:
        out, err = procs[0].communicate(timeout=600)
        if procs[0].returncode != 0:
            raise RuntimeError(f"the collectives' probe failed: {err.strip().splitlines()[-1:]}")
        return json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
