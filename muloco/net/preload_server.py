"""The preloaded-process server: `python -m muloco.net.preload_server FD`, started by preloaded.py's client
once per calling process. It imports torch and muloco once (PRELOAD), then forks a child per request on
socket FD; the server itself never runs a torch op, so no thread pool or device context is copied into the
children.

What a fresh process would set up from its environment, the child sets up itself: the environment, working
directory, stdin/stdout/stderr, session, parent-death signal, thread count (OMP_NUM_THREADS), buffering
(PYTHONUNBUFFERED), sys.argv, the random modules' seeds, and at exit: threads joined, atexit handlers run,
streams flushed. It then runs `python -m muloco ARGV` (the package's __main__, by module path: this layer
does not import the CLI) or `python SCRIPT ARGV`. The server ends with its caller (it reads the end of its
socket), first sending SIGTERM to the children that asked to die with their parent.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

from muloco.net.parent_death import sigterm_when_parent_dies

# Imported once by the server, by name: what every `muloco train` child would import first.
PRELOAD = ("torch", "torch._dynamo", "muloco.cli", "muloco.run.trainer")
MAX_REQUEST = 1 << 20
_STDIO = 3  # stdin, stdout, stderr; then the exit-status pipe


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
    import runpy

    if request.get("script"):
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = str(Path(script).resolve().parent)  # `python SCRIPT` puts the script's folder first

        def main() -> int:
            runpy.run_path(script, run_name="__main__")
            return 0
    else:  # `python -m muloco ARGV`: runpy sets sys.argv[0] to muloco/__main__.py as the interpreter does
        sys.argv = ["-m", *request["argv"]]

        def main() -> int:
            runpy.run_module("muloco", run_name="__main__", alter_sys=True)  # its exit: SystemExit
            return 0

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
