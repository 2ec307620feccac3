"""`muloco launch --nproc N [--backend torch|hivemind|torchft] CONFIG [KEY=VALUE ...]`: N local processes
of `muloco train`.

torch: wired as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT).
When one process fails, the others are ended (SIGTERM, then SIGKILL after a grace period): they could only
wait for it.
hivemind: a local swarm. Peer 0 starts a new swarm; once it prints its multiaddrs the others join it
(`backend.hivemind.initial_peers`). Each peer is a run of its own (`run.name=<name>-peer<i>`, data shard i).
Peers are independent: one that fails does not stop the others, which go on without it.
torchft: the launcher starts a torchft lighthouse on loopback (unless backend.torchft.lighthouse names a
running one), then N / R workers of R = ranks_per_worker processes each (`run.name=<name>-worker<i>`, data
shard i, i from backend.torchft.replica_id, default 0), that find it through backend.torchft.lighthouse;
the R ranks of a worker are a torch.distributed world of their own (their own MASTER_PORT). Like hivemind
peers the workers are independent: one that exits is reported (its other ranks are ended), with the command
that brings it back, and the others go on.

Each line a process prints is prefixed with its rank. Ctrl+C / SIGTERM are forwarded to every process. The
launcher exits with the first failed process's exit code, after repeating its last error line.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from muloco.net.preloaded import start_muloco

GRACE_S = 10.0  # how long ended processes get to write their checkpoint before SIGKILL
SWARM_START_TIMEOUT_S = 120.0  # how long peer 0 may take to print its multiaddrs
_MADDRS = re.compile(r"join with backend\.hivemind\.initial_peers=(\[.*\])")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, sink, tail: deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        sink.write(f"{prefix}{line}")
        sink.flush()
    stream.close()


CAUSE_GRACE_S = 2.0  # how long a rank's exit code waits for another rank seen killed by a signal


def _cause(failed: list[int], codes: list[int | None]) -> int | None:
    """The failed rank to name: one killed by a signal (negative code) first, else the lowest."""
    return min(failed, key=lambda rank: (codes[rank] > 0, rank)) if failed else None


def launch(
    nproc: int,
    config: str,
    overrides: list[str],
    backend: str = "torch",
    run_name: str = "run",
    torchft_section=None,
    ranks_per_worker: int = 1,
) -> int:
    if nproc < 1:
        print(f"muloco: error: --nproc must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    R = ranks_per_worker if backend == "torchft" else 1  # torch: the trainer splits its world itself
    if nproc % R:
        print(
            f"muloco: error: --nproc ({nproc}) must be a multiple of ranks_per_worker ({R})", file=sys.stderr
        )
        return 2
    lighthouse, lighthouse_addr = None, None
    if backend == "torchft" and torchft_section.lighthouse:  # join a running job's lighthouse
        lighthouse_addr = torchft_section.lighthouse
    elif backend == "torchft":
        try:
            lighthouse, lighthouse_addr = start_lighthouse(torchft_section)
        except ImportError:
            print(
                'muloco: error: --backend torchft needs torchft: pip install -e ".[torchft]"', file=sys.stderr
            )
            return 2
        print(f"muloco: torchft lighthouse at {lighthouse_addr}", file=sys.stderr, flush=True)
    first_worker = (torchft_section.replica_id or 0) if backend == "torchft" else 0
    # torch: one world; torchft: a world per worker (each process one, unless a worker has R ranks).
    ports = [free_port() for _ in range(nproc // R)] if R > 1 else [free_port()] * nproc
    procs: list[subprocess.Popen] = []
    tails: list[deque] = []
    threads = []
    swarm_maddrs: list[str] = []
    for rank in range(nproc):
        extra = []
        if backend == "hivemind":
            extra = [f"run.name={run_name}-peer{rank}", f"backend.hivemind.wait_for_peers={nproc}"]
            if rank > 0:
                swarm_maddrs = swarm_maddrs or wait_for_maddrs(procs[0], lambda: list(tails[0]))
                if not swarm_maddrs:
                    end_processes(procs)
                    last = next((line for line in reversed(tails[0]) if line.strip()), "")
                    print(f"muloco: error: peer 0 did not start a swarm: {last}", file=sys.stderr)
                    return 1
                extra.append(f"backend.hivemind.initial_peers={json.dumps(swarm_maddrs)}")
        worker = first_worker + rank // R
        if backend == "torchft":
            extra = [
                f"run.name={run_name}-worker{worker}",
                f"backend.torchft.lighthouse={lighthouse_addr}",
                f"backend.torchft.replica_id={worker}",
            ]
            if lighthouse is not None:  # a job on loopback; its first quorum waits for these workers
                extra += [
                    "backend.torchft.hostname=127.0.0.1",
                    f"backend.torchft.wait_for_workers={nproc // R}",
                ]
        env = {
            **os.environ,
            "RANK": str(rank % R if R > 1 else rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(R if R > 1 else nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(ports[rank // R]),
            "PYTHONUNBUFFERED": "1",
        }
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))  # share the cores
        args = ["train", config, *overrides, f"backend.kind={backend}", *extra]
        # Own process group: a terminal's Ctrl+C reaches the launcher only, which forwards it once. Forked
        # from the preloaded server (muloco/net/preloaded.py): the ranks spare torch's import.
        proc = start_muloco(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            new_session=True,
            die_with_parent=True,
        )
        procs.append(proc)
        tail: deque = deque(maxlen=20)
        tails.append(tail)
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, f"[rank {rank}] ", sink, tail), daemon=True)
            t.start()
            threads.append(t)

    forwarded: list[int] = []

    def forward(signum, frame):
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    failed_rank = None
    independent = backend in ("hivemind", "torchft")  # torch ranks would only wait for a failed one
    reported: set[int] = set()
    first_failure_at = None
    try:
        while any(p.poll() is None for p in procs):
            polled = [p.poll() for p in procs]
            failed = [rank for rank, code in enumerate(polled) if code not in (None, 0)]
            if failed and failed_rank is None and not forwarded:
                first_failure_at = first_failure_at or time.monotonic()
                # A rank killed by a signal is the cause: the others exit 1 on its reset, and may be seen
                # first (a forked rank's exit status arrives when the preloaded server reaps it), so an
                # exit code waits CAUSE_GRACE_S for a killed rank before it is named.
                killed = any(polled[rank] < 0 for rank in failed)
                if killed or time.monotonic() - first_failure_at >= CAUSE_GRACE_S:
                    failed_rank = _cause(failed, polled)
                    if not independent:
                        end_processes(procs)
            for rank, code in enumerate(polled):
                worker = rank // R
                if (
                    code not in (None, 0)
                    and backend == "torchft"
                    and worker not in reported
                    and not forwarded
                ):
                    reported.add(worker)
                    end_processes(procs[worker * R : (worker + 1) * R])  # a worker is all its ranks or none
                    index = first_worker + worker
                    _report_torchft_exit(index, code, config, overrides, run_name, lighthouse_addr, R)
            time.sleep(0.1)
    finally:
        end_processes(procs)
        if lighthouse is not None:
            lighthouse.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in threads:
            t.join(timeout=5)
    codes = [p.returncode for p in procs]
    if failed_rank is None:
        failed_rank = _cause([r for r, c in enumerate(codes) if c != 0], codes)
    if failed_rank is None:
        return 0
    code = codes[failed_rank]
    last = next((line for line in reversed(tails[failed_rank]) if line.strip()), "")
    print(f"muloco: rank {failed_rank} exited with code {code}: {last}", file=sys.stderr)
    return code if code and code > 0 else 1


def start_lighthouse(section):
    """A torchft lighthouse on loopback (in this process: it lives as long as the launcher) and its
    address. Its options come from backend.torchft (min_replicas, join_timeout_s, heartbeat_timeout_s)."""
    os.environ.setdefault("RUST_LOG", "warn")  # its INFO lines log every quorum; the workers inherit it
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=section.min_replicas,
        join_timeout_ms=int(section.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(section.heartbeat_timeout_s * 1000),
    )
    port = server.address().rsplit(":", 1)[1]
    return server, f"http://127.0.0.1:{port}"


def _report_torchft_exit(
    worker: int, code: int, config: str, overrides: list[str], run_name: str, lighthouse: str, ranks: int
) -> None:
    """A torchft worker exited: the others go on; say how to bring it back (it rejoins live)."""
    # As this launcher's workers: on loopback, at its lighthouse, under the worker's index.
    where = [f"backend.torchft.lighthouse={lighthouse}", f"backend.torchft.replica_id={worker}"]
    where.append("backend.torchft.hostname=127.0.0.1")
    if ranks == 1:
        command = ["muloco", "train", config, *overrides, "backend.kind=torchft"]
        command += [f"run.name={run_name}-worker{worker}", *where]
    else:  # its R ranks, joining this lighthouse (the launcher names the run and wires the ranks)
        command = [
            "muloco",
            "launch",
            "--backend",
            "torchft",
            "--nproc",
            str(ranks),
            config,
            *overrides,
            *where,
        ]
    print(
        f"muloco: worker {worker} exited with code {code}; the others go on without it. To bring it back "
        f"(it rejoins at the next sync with the run's state): {shlex.join(command)}",
        file=sys.stderr,
        flush=True,
    )


def wait_for_maddrs(proc: subprocess.Popen, read_lines: Callable[[], Iterable[str]]) -> list[str]:
    """A peer's multiaddrs, from the line it logs once its swarm is up (`read_lines`: its output so far);
    empty if it died or did not get there within SWARM_START_TIMEOUT_S."""
    deadline = time.monotonic() + SWARM_START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        for line in read_lines():
            match = _MADDRS.search(line)
            if match:
                return [str(m) for m in ast.literal_eval(match.group(1))]
        time.sleep(0.1)
    return []


def end_processes(procs: list[subprocess.Popen], whole_group: bool = False) -> None:
    """SIGTERM every live process, SIGKILL what is still alive after the grace period. whole_group: signal
    each one's process group (it was started with start_new_session), so its children go too."""

    def send(p: subprocess.Popen, signum: int) -> None:
        try:
            if whole_group:
                os.killpg(p.pid, signum)
            else:
                p.send_signal(signum)
        except (ProcessLookupError, PermissionError):
            pass

    for p in procs:
        if p.poll() is None:
            send(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()
