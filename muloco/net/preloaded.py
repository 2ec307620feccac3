"""`muloco` processes forked from a server that imported torch and muloco once: the callers' side.

A fresh `python -m muloco train` spends ~3 s of CPU before its first step importing torch, torch._dynamo (the
first optimizer imports it) and muloco; a sweep of 36 small runs, or a launch of 4 ranks, pays it every time.
`start_muloco` instead asks a small server (preload_server.py), started once per calling process, to fork
the run from a copy that has those modules imported (the zygote pattern: multiprocessing's forkserver,
Android's zygote). `start_script` does the same for `python SCRIPT` (the tests' multi-rank helper,
tests/combo_rank.py), and `netns=` puts a child in a network namespace (the testbed's hosts).

Variables read while torch is imported (the CPU kernels' ISA, allocator and library settings) cannot be
changed after the fork: a request whose environment differs from the server's in any variable not in
RUN_TIME_VARIABLES gets a plain `python -m muloco` process, as does every request when MULOCO_PRELOAD=0,
and every request after the server could not be reached.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from muloco.net.parent_death import sigterm_when_parent_dies

log = logging.getLogger("muloco")
# Read by muloco, torch.distributed or the child's set-up (preload_server.py) when the run starts, never at
# import.
RUN_TIME_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCHFT_LIGHTHOUSE", "RUST_LOG", "GLOO_SOCKET_IFNAME"}
    | {"PYTEST_CURRENT_TEST"}  # pytest names the running test in it
)
RUN_TIME_PREFIXES = ("MULOCO_", "WANDB_", "HF_")  # HF_: transformers is imported by the run, not preloaded


def enabled() -> bool:
    return os.environ.get("MULOCO_PRELOAD", "1") != "0"


def differs_at_import(env: dict[str, str], server_env: dict[str, str]) -> str | None:
    """The first variable, read at import, whose value in `env` is not the server's; None if there is none.
    OMP_NUM_THREADS may differ when `env` sets it (the child applies it); unset, it must be unset in both."""
    for name in sorted(set(env) | set(server_env)):
        if env.get(name) == server_env.get(name):
            continue
        if name == "OMP_NUM_THREADS" and name not in env:
            return name
        if name not in RUN_TIME_VARIABLES and not name.startswith(RUN_TIME_PREFIXES):
            return name
    return None


class PreloadedProcess:
    """What the callers of subprocess.Popen use (pid, poll, wait, send_signal, terminate, kill, returncode,
    stdout, stderr, communicate) for a child of the server. Its exit code arrives on a pipe the server
    writes when it reaps the child: negative for a signal, as Popen reports it."""

    def __init__(self, args: list[str], pid: int, status_fd: int, stdout: IO | None, stderr: IO | None):
        self.args, self.pid, self.returncode = args, pid, None
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self._status = os.fdopen(status_fd, "rb", buffering=0)
        os.set_blocking(status_fd, False)
        self._read = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect(left)
        return self.returncode

    def _collect(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        chunk = self._status.read()  # None: nothing yet after all; b"": the end
        if chunk is None:
            return
        self._read += chunk
        if self._read.endswith(b"\n") or not chunk:  # the code, or the server died without sending one
            text = self._read.strip()
            self.returncode = int(text) if text else 255
            self._status.close()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both pipes read to their end (a thread each, so neither can fill and block the child)."""
        out: dict[str, str] = {}

        def drain(name: str, stream: IO | None) -> None:
            if stream is not None:
                out[name] = stream.read()
                stream.close()

        readers = [
            threading.Thread(target=drain, args=(n, s)) for n, s in (("o", self.stdout), ("e", self.stderr))
        ]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join(timeout)
        return out.get("o"), out.get("e")


class _Client:
    """This process's connection to its server (started at the first request)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.server: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.broken = False  # a request failed: plain processes from now on

    def connect(self) -> socket.socket:
        if self.sock is not None and self.server is not None and self.server.poll() is None:
            return self.sock
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ)
        cmd = [sys.executable, "-m", "muloco.net.preload_server", str(theirs.fileno())]
        # Its own session: a terminal's Ctrl+C is for the caller, which forwards it to the runs.
        self.server = subprocess.Popen(
            cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True
        )
        theirs.close()
        self.sock = mine
        return mine

    def request(self, payload: dict, fds: list[int]) -> int:
        with self.lock:
            try:
                sock = self.connect()
                socket.send_fds(sock, [json.dumps(payload).encode()], fds)
                sock.settimeout(300)  # the first request waits for the server's imports
                reply = sock.recv(4096).decode()
                if not reply.isdigit():
                    raise OSError(f"the preloaded-process server could not fork: {reply or 'it exited'}")
            except OSError:
                self.broken = True
                raise
        return int(reply)


_CLIENT = _Client()


def start_muloco(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: Any = None,
    stderr: Any = None,
    new_session: bool = False,
    die_with_parent: bool = False,
    netns: str | None = None,
) -> PreloadedProcess | subprocess.Popen:
    """`python -m muloco ARGS` as a child of the preloaded server (a plain process where it cannot be: see
    the module's doc, or when the server cannot be reached). stdout/stderr as subprocess takes them: None
    (inherit), PIPE (text), STDOUT (for stderr), DEVNULL, a file object or a descriptor. stdin is
    /dev/null. netns: run it in that network namespace (`ip netns exec NETNS`'s network, the testbed's
    hosts)."""
    return _start(_Request(None, args, env, cwd, stdout, stderr, new_session, die_with_parent, netns))


def start_script(
    script: str | Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    die_with_parent: bool = False,
) -> PreloadedProcess | subprocess.Popen:
    """`python SCRIPT ARGS` as a child of the preloaded server (as start_muloco; the tests' helper
    processes that import torch and muloco, e.g. tests/combo_rank.py)."""
    return _start(_Request(str(script), args, env, None, stdout, stderr, False, die_with_parent, None))


@dataclass(frozen=True)
class _Request:
    """One process to start, forked or plain: `python SCRIPT ARGS` or (no script) `python -m muloco ARGS`."""

    script: str | None
    args: list[str]
    env: dict[str, str] | None
    cwd: str | Path | None
    stdout: Any
    stderr: Any
    new_session: bool
    die_with_parent: bool
    netns: str | None

    @property
    def program(self) -> list[str]:
        """What follows the interpreter on the command line, before ARGS."""
        return [self.script] if self.script else ["-m", "muloco"]

    @property
    def command(self) -> list[str]:
        """The command a plain process runs (its `ip netns exec` prefix aside)."""
        return [sys.executable, *self.program, *self.args]


def _start(request: _Request) -> PreloadedProcess | subprocess.Popen:
    env = dict(os.environ if request.env is None else request.env)
    request = replace(request, args=[str(a) for a in request.args], env=env)
    what = request.script or " ".join(["muloco", *request.args[:1]])
    differs = differs_at_import(env, _CLIENT.env or dict(os.environ))
    if not enabled() or _CLIENT.broken or differs is not None:
        if differs is not None:
            log.debug("a plain process for `%s`: %s differs from the server's", what, differs)
        return _plain(request)
    try:
        return _forked(request)
    except OSError as exc:  # the server died or could not fork: a plain process does the same work
        log.warning("starting `%s` as a plain process: %s", what, exc)
        return _plain(request)


def _plain(request: _Request) -> subprocess.Popen:
    inside = ["ip", "netns", "exec", request.netns] if request.netns else []
    return subprocess.Popen(
        [*inside, *request.command],
        env=request.env,
        cwd=request.cwd,
        stdin=subprocess.DEVNULL,
        stdout=request.stdout,
        stderr=request.stderr,
        text=True,
        start_new_session=request.new_session,
        preexec_fn=sigterm_when_parent_dies if request.die_with_parent else None,
    )


def _forked(request: _Request) -> PreloadedProcess:
    opened: list[int] = []  # descriptors made here, closed once the server holds its copies
    readers: dict[str, IO] = {}

    def target(name: str, spec: Any, inherit: int) -> int:
        if spec is None:
            return inherit
        if spec == subprocess.PIPE:
            read_end, write_end = os.pipe()
            readers[name] = os.fdopen(read_end, "r", encoding="utf-8", errors="replace")
            opened.append(write_end)
            return write_end
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            opened.append(fd)
            return fd
        return spec if isinstance(spec, int) else spec.fileno()

    status_read, status_write = os.pipe()
    opened.append(status_write)
    try:
        out_fd = target("stdout", request.stdout, 1)
        err_fd = out_fd if request.stderr == subprocess.STDOUT else target("stderr", request.stderr, 2)
        in_fd = target("stdin", subprocess.DEVNULL, 0)
        payload = {
            "script": request.script,
            "program": request.program,
            "argv": request.args,
            "env": request.env,
            "cwd": str(request.cwd or os.getcwd()),
            "new_session": request.new_session,
            "die_with_parent": request.die_with_parent,
            "netns": request.netns,
        }
        pid = _CLIENT.request(payload, [in_fd, out_fd, err_fd, status_write])
    except BaseException:
        os.close(status_read)
        for stream in readers.values():
            stream.close()
        raise
    finally:
        for fd in opened:
            os.close(fd)
    return PreloadedProcess(request.command, pid, status_read, readers.get("stdout"), readers.get("stderr"))
