"""`muloco` processes forked from a server that imported torch and muloco once.

A fresh `python -m muloco train` spends ~3 s of CPU before its first step importing torch, torch._dynamo (the
first optimizer imports it) and muloco; a sweep of 36 small runs, or a launch of 4 ranks, pays it every time.
`start_muloco` instead asks a small server, started once per calling process, to fork the run from a copy
that has those modules imported (the zygote pattern: multiprocessing's forkserver, Android's zygote). The
server never runs a torch op, so no thread pool or device context is copied into the children.
`start_script` does the same for `python SCRIPT` (the tests' multi-rank helper, tests/combo_rank.py), and
`netns=` puts a child in a network namespace (the testbed's hosts, muloco/net/testbed.py).

What a fresh process would set up from its environment, the child sets up itself: the environment, working
directory, stdin/stdout/stderr, session, parent-death signal, thread count (OMP_NUM_THREADS), buffering
(PYTHONUNBUFFERED), sys.argv, the random modules' seeds, and at exit: threads joined, atexit handlers run,
streams flushed. Variables read while torch is imported (the CPU kernels' ISA, allocator and library
settings) cannot be changed after the fork: a request whose environment differs from the server's in any
variable not in RUN_TIME_VARIABLES gets a plain `python -m muloco` process, as does every request when
MULOCO_PRELOAD=0. The server ends with its caller (it reads the end of its socket), first sending SIGTERM
to the children that asked to die with their parent.
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

log = logging.getLogger("muloco")
PRELOAD = ("torch", "torch._dynamo", "muloco.cli", "muloco.run.trainer")
# Read by muloco, torch.distributed or the child set-up below when the run starts, never at import.
RUN_TIME_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "TORCHFT_LIGHTHOUSE", "RUST_LOG", "GLOO_SOCKET_IFNAME"}
    | {"PYTEST_CURRENT_TEST"}  # pytest names the running test in it
)
RUN_TIME_PREFIXES = ("MULOCO_", "WANDB_", "HF_")  # HF_: transformers is imported by the run, not preloaded
MAX_REQUEST = 1 << 20
_STDIO = 3  # stdin, stdout, stderr; then the exit-status pipe


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
        cmd = [sys.executable, "-m", "muloco.net.preloaded", str(theirs.fileno())]
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
    from muloco.net.launch import sigterm_when_parent_dies

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


# ---- the server (python -m muloco.net.preloaded FD) ----


def serve(fd: int) -> None:
    """Fork a `muloco` child per request on socket `fd`; report each child's exit code on the pipe that came
    with its request. At the socket's end (the caller is gone), SIGTERM the children that asked to die with
    their parent, wait for every child, and exit."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    try:  # set up now: it finds the argv area through the environment, which a child replaces
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    sock = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: dict[int, tuple[int, bool]] = {}  # pid -> (status pipe, dies with the caller)
    open_ = True
    while open_ or children:
        watched = [sock, wake_read] if open_ else [wake_read]
        ready, _, _ = select.select(watched, [], [], 1.0)
        if wake_read in ready:
            os.read(wake_read, 4096)
        if open_ and sock in ready:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, _STDIO + 1)
            if not message:
                open_ = False
                for pid, (_, dies) in children.items():
                    if dies:
                        _signal(pid, signal.SIGTERM)
            else:
                _fork_child(json.loads(message), fds, sock, (wake_read, wake_write), children)
        _reap(children)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _reap(children: dict[int, tuple[int, bool]]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        entry = children.pop(pid, None)
        if entry is not None:
            try:
                os.write(entry[0], f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the caller is gone
                pass
            os.close(entry[0])


def _fork_child(request: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int], children) -> None:
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(str(exc).encode())
        return
    if pid == 0:
        try:
            sock.close()
            for fd in (*wake, *(status for status, _ in children.values())):
                os.close(fd)
            code = _run_child(request, fds)
        except BaseException:  # the set-up itself failed: say so where the caller reads
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    for fd in fds[:_STDIO]:
        os.close(fd)
    children[pid] = (fds[_STDIO], request["die_with_parent"])
    sock.send(str(pid).encode())


def _run_child(request: dict, fds: list[int]) -> int:
    """In the forked child: become what `python -m muloco ARGV` (or `python SCRIPT ARGV`) would be, run it,
    exit as it would."""
    import importlib

    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request["new_session"]:
        os.setsid()
    if request["die_with_parent"]:
        from muloco.net.launch import sigterm_when_parent_dies

        sigterm_when_parent_dies()
    for target, fd in enumerate(fds[:_STDIO]):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request.get("netns"):  # after the descriptors: a failure is reported in the caller's log
        _enter_network_namespace(request["netns"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first (a factory module there)
    importlib.invalidate_caches()  # files written since the server's imports (a test's factory module)
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    _reseed()
    if "OMP_NUM_THREADS" in os.environ:  # read at torch's import in a fresh process
        import torch

        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    _set_title([*request["program"], *request["argv"]])
    if request.get("script"):
        import runpy

        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = str(Path(script).resolve().parent)  # `python SCRIPT` puts the script's folder first

        def main() -> int:
            runpy.run_path(script, run_name="__main__")
            return 0
    else:
        import muloco.cli

        sys.argv = [str(Path(muloco.cli.__file__).with_name("__main__.py")), *request["argv"]]

        def main() -> int:
            return muloco.cli.main(request["argv"])

    code = 1
    try:
        code = main()
    except SystemExit as exc:  # argparse's usage errors, sys.exit in a command
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        threading._shutdown()  # what the interpreter's exit does: wait for non-daemon threads
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


CLONE_NEWNET = 0x40000000  # <sched.h>
NETNS_DIR = "/var/run/netns"  # where `ip netns add` keeps a namespace (iproute2's NETNS_RUN_DIR)


def _enter_network_namespace(name: str) -> None:
    """Join the named network namespace, as `ip netns exec` does for the network (its other steps, a mount
    namespace with /etc/netns files and /sys remounted, nothing here reads). Before any socket exists: a
    socket keeps the namespace it was made in."""
    fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot enter network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _fresh_streams(unbuffered: bool) -> None:
    """sys.stdout/stderr on the new descriptors 1 and 2, buffered as a fresh interpreter buffers them."""
    import io

    for fd, name in ((1, "stdout"), (2, "stderr")):
        line = unbuffered or name == "stderr" or os.isatty(fd)
        stream = io.TextIOWrapper(
            open(fd, "wb", closefd=False, buffering=0 if unbuffered else -1),
            encoding="utf-8",
            errors="backslashreplace" if name == "stderr" else "strict",
            line_buffering=line,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8")


def _set_title(command: list[str]) -> None:
    """`ps` and /proc/PID/cmdline show the run as the shell command that would start it fresh, led by its
    rank's variables (LOCAL_RANK=1 RANK=1 python -m muloco train ...), not as the server's command."""
    try:
        import setproctitle
    except ImportError:  # a dependency; without it the title stays the server's
        return
    ranks = [f"{name}={os.environ[name]}" for name in ("LOCAL_RANK", "RANK") if name in os.environ]
    setproctitle.setproctitle(" ".join([*ranks, sys.executable, *command]))


def _reseed() -> None:
    """The server's seeds are copied into every child; a fresh process draws its own."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
