"""muloco processes forked from the preloaded server behave as fresh `python -m muloco` processes."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import TINY
from test_helpers import LineReader, final_global_params

from muloco.net import preloaded
from muloco.net.preloaded import PreloadedProcess, differs_at_import, start_muloco

QUICKSTART = "configs/quickstart.yaml"


@pytest.fixture(autouse=True)
def _own_server(monkeypatch):
    """A client of its own per test: another test in this worker may have changed the environment the
    worker's server started with (a variable read at import sends every later request to a plain process)."""
    monkeypatch.setattr(preloaded, "_CLIENT", preloaded._Client())


def _env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow  # two tiny runs, one fresh process (~4 s of CPU)
def test_a_preloaded_run_is_bitwise_the_run_of_a_fresh_process(tmp_path):
    """Same config, same seed: the global parameters of a run forked from the server and of a run of
    `python -m muloco train` are equal bit for bit, and both write the same summary status."""
    args = ["train", QUICKSTART, *TINY, f"run.output_dir={tmp_path}"]
    fresh = subprocess.run(
        [sys.executable, "-m", "muloco", *args, "run.name=fresh"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    forked = start_muloco(
        [*args, "run.name=forked"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert isinstance(forked, PreloadedProcess)
    _, err = forked.communicate(timeout=120)
    assert forked.returncode == 0, err[-2000:]
    for a, b in zip(
        final_global_params(tmp_path / "fresh"), final_global_params(tmp_path / "forked"), strict=True
    ):
        assert (a == b).all()
    assert "summary" in err or "final" in err  # its log lines reach the caller's pipe


def test_exit_codes_and_output_are_the_fresh_processs(tmp_path):
    """A bad override exits 2 with the one-line error on stderr; `config` prints on stdout and exits 0."""
    bad = start_muloco(["config", QUICKSTART, "inner.lrr=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = bad.communicate(timeout=300)
    assert isinstance(bad, PreloadedProcess) and bad.returncode == 2
    assert err.strip().splitlines() == [
        "muloco: error: override 'inner.lrr=1': unknown key 'lrr' in inner; did you mean 'lr'?"
    ]
    log = tmp_path / "out.log"
    with open(log, "w") as sink:
        good = start_muloco(
            ["config", os.path.abspath(QUICKSTART), "workers=2"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    assert good.wait(timeout=60) == 0
    assert "workers: 2" in log.read_text()


def test_a_script_runs_as_python_script_would(tmp_path, monkeypatch):
    """start_script: `python SCRIPT ARGS` forked from the server, as a plain process (MULOCO_PRELOAD=0) runs
    it: as __main__ with its arguments and its own folder first on sys.path, its exit code and output the
    caller's, and an exception's traceback on stderr with exit code 1. `ps` shows both as the same command,
    and the caller's handle has the same args."""
    script = tmp_path / "tool" / "show.py"
    script.parent.mkdir()
    (script.parent / "beside.py").write_text("WHERE = 'beside the script'\n")
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            import beside
            if sys.argv[1] == "raise":
                raise ValueError("on purpose")
            shown = open("/proc/self/cmdline").read().replace("\\0", " ").split()
            print(json.dumps([__name__, sys.argv[1:], beside.WHERE, shown]))
            sys.exit(int(sys.argv[2]))
            """
        )
    )
    seen = []
    for preload in ("1", "0"):
        monkeypatch.setenv("MULOCO_PRELOAD", preload)
        proc = preloaded.start_script(script, ["show", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        assert isinstance(proc, PreloadedProcess) == (preload == "1")
        seen.append((proc.returncode, json.loads(out), proc.args))
        failed = preloaded.start_script(script, ["raise"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = failed.communicate(timeout=120)
        assert failed.returncode == 1 and err.strip().splitlines()[-1] == "ValueError: on purpose"
    shown = [sys.executable, str(script), "show", "3"]
    assert seen[0] == seen[1] == (3, ["__main__", ["show", "3"], "beside the script", shown], shown)


def test_signals_reach_the_child_and_its_code_reports_them(tmp_path):
    """A run in its own session is stopped by SIGKILL (returncode -9, as Popen reports it); SIGINT reaches a
    run as Ctrl+C (it checkpoints and exits 130), since the child restores Python's default handler."""
    args = ["train", QUICKSTART, *TINY, "train.total_tokens=3000000", f"run.output_dir={tmp_path}"]
    killed = start_muloco([*args, "run.name=k"], env=_env(), stderr=subprocess.PIPE, new_session=True)
    lines = LineReader(killed.stderr)
    lines.wait_for("step", timeout=60)
    assert os.getpgid(killed.pid) == killed.pid  # its own session and group
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL
    interrupted = start_muloco([*args, "run.name=i"], env=_env(), stderr=subprocess.PIPE)
    LineReader(interrupted.stderr).wait_for("step", timeout=60)
    interrupted.send_signal(signal.SIGINT)
    assert interrupted.wait(timeout=60) == 130


def test_a_wait_past_its_timeout_raises_as_popens_does(tmp_path):
    args = ["train", QUICKSTART, *TINY, "train.total_tokens=3000000", f"run.output_dir={tmp_path}"]
    proc = start_muloco(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        assert time.monotonic() - started < 5 and proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_variable_read_at_import_gets_a_fresh_process(monkeypatch):
    """The kernels' ISA is fixed when torch is imported: such a request is not forked from the server."""
    server_env = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert (
        differs_at_import({**server_env, "ATEN_CPU_CAPABILITY": "avx2"}, server_env) == "ATEN_CPU_CAPABILITY"
    )
    assert differs_at_import({**server_env, "PYTHONPATH": "x"}, server_env) == "PYTHONPATH"
    assert differs_at_import({"PATH": "/bin"}, server_env) == "OMP_NUM_THREADS"  # unset: torch's own default
    assert (
        differs_at_import({**server_env, "OMP_NUM_THREADS": "1", "RANK": "3", "MULOCO_X": "1"}, server_env)
        is None
    )
    proc = start_muloco(
        ["config", QUICKSTART], env=_env(ATEN_CPU_CAPABILITY="default"), stdout=subprocess.DEVNULL
    )
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=120) == 0
    monkeypatch.setenv("MULOCO_PRELOAD", "0")
    plain = start_muloco(["config", QUICKSTART], stdout=subprocess.DEVNULL)
    assert isinstance(plain, subprocess.Popen) and plain.wait(timeout=120) == 0
    assert preloaded.enabled() is False


def test_a_server_that_fails_leaves_plain_processes_and_a_warning(monkeypatch, caplog):
    """A server that died or could not fork must not cost the run: it starts as a plain process, and every
    later one too (the client does not keep restarting a failing server)."""
    client = preloaded._Client()
    monkeypatch.setattr(preloaded, "_CLIENT", client)

    def fails(payload, fds):
        client.broken = True
        raise ConnectionResetError("the server exited")

    monkeypatch.setattr(client, "request", fails)
    first = start_muloco(["config", QUICKSTART], stdout=subprocess.DEVNULL)
    assert isinstance(first, subprocess.Popen) and first.wait(timeout=120) == 0
    assert "starting `muloco config` as a plain process: the server exited" in caplog.text
    second = start_muloco(["config", QUICKSTART], stdout=subprocess.DEVNULL)
    assert client.broken and isinstance(second, subprocess.Popen) and second.wait(timeout=120) == 0


def test_children_that_die_with_their_parent_end_when_the_caller_goes(tmp_path):
    """A caller that dies (even by SIGKILL) closes its socket: the server SIGTERMs the children that asked
    to die with it, so no rank is left waiting on its collective."""
    script = tmp_path / "caller.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from muloco.net.preloaded import start_muloco\n"
        f"args = ['train', {QUICKSTART!r}, *{TINY!r}, 'train.total_tokens=3000000']\n"
        f"args.append('run.output_dir={tmp_path}')\n"
        "p = start_muloco(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, die_with_parent=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_env())
    child = None
    try:
        child = int(caller.stdout.readline())
        caller.kill()
        caller.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.2)
        assert not _alive(child)
    finally:
        caller.kill()
        caller.wait(timeout=30)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
