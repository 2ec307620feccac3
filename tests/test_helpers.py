"""Shared helpers for tests (importable because pyproject sets pytest's pythonpath to tests/)."""

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.data import ReplicaStream
from muloco.models import build_model
from muloco.net import preloaded
from muloco.optim import build_inner_optimizer
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.replica import set_lr_multiplier


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def hand_inner_steps(cfg, trainer, replica_index, steps):
    """Train a fresh copy of the initial model on replica r's stream, as a real worker would."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, 256)
    opt = build_inner_optimizer(model, cfg.inner)
    stream = ReplicaStream(trainer.data.train, cfg.model.seq_len, replica_index, cfg.workers, cfg.run.seed)
    seqs = cfg.worker_batch_tokens // cfg.model.seq_len
    for step in range(steps):
        t = cfg.train
        set_lr_multiplier(
            opt, lr_multiplier(step, cfg.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)
        )
        x, y = stream.next_batch(seqs)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params_of(model)


def sync_records(run_dir: Path) -> list[dict]:
    """The `kind: sync` records of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "sync"]


def final_global_params(run_dir: Path) -> list[torch.Tensor]:
    """The global parameters in a run's newest checkpoint."""
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["engine"]["outer"]["params"]


def assert_same_global_params(*run_dirs: Path) -> None:
    """Every run's newest checkpoint holds the same global parameters, bit for bit."""
    reference = final_global_params(run_dirs[0])
    for run_dir in run_dirs[1:]:
        for a, b in zip(reference, final_global_params(run_dir), strict=True):
            assert torch.equal(a, b), run_dir


# Two code paths that sum in another order (FSDP's reduce-scatter, a worker's ranks each summing their
# micro-batches, R = 1 against R = 2) differ by rounding. A sum's rounding error scales with the size of its
# terms, i.e. with the tensor's scale, not with each element: a near-zero element can be off by several
# times its own value (2.5e-6 on a 1e-7 element was seen on an AVX2 CPU). So the bound is relative to the
# tensor's largest element: fp32's eps (1.2e-7) times the steps and terms summed stays far below 1e-4,
# while a real mistake (a missing term, a wrong scale) moves elements by 1e-2 of the scale or more.
ROUNDING_REL = 1e-4


def assert_equal_up_to_rounding(actual: torch.Tensor, expected: torch.Tensor, rel: float = ROUNDING_REL):
    """max |actual - expected| <= rel x max |expected| (see ROUNDING_REL)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= rel * scale, f"max error {error:.3g} > {rel} x max |expected| {scale:.3g}"


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    # One thread per process: tests start several on 2 cores, and results stay deterministic.
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def run_muloco(
    *args, timeout: float = 120, env: dict[str, str] | None = None, cwd=None
) -> subprocess.CompletedProcess:
    """`python -m muloco ARGS` to completion, output captured: forked from the preloaded server, as
    `muloco sweep` and `muloco launch` start their runs (tests/run/test_preloaded.py holds it to a fresh
    process, bit for bit), so each call spares torch's import (~3 s of CPU)."""
    proc = preloaded.start_muloco(
        [*map(str, args)], env=_env(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_muloco_here(*args) -> subprocess.CompletedProcess:
    """`muloco ARGS` through `muloco.cli.main` in this process: the code `python -m muloco` runs, with
    its exit code and what it prints (log lines included, as the process's stderr has them), for commands
    that stop at their input's checks. It spares a process's start: ~4 s of CPU on 2 cores (torch's
    import, then dynamo's on the first optimizer) per call. Runs that train use run_muloco: their state
    (signal handlers, imported factory modules) must not outlive them."""
    from muloco.cli import main

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler = logging.StreamHandler(err)  # what cli's logging.basicConfig gives a fresh process
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return subprocess.CompletedProcess(["muloco", *map(str, args)], code, out.getvalue(), err.getvalue())


def start_muloco(*args, env: dict[str, str] | None = None):
    """`python -m muloco ARGS` in the background (forked from the preloaded server, as run_muloco), stdout
    and stderr piped; the caller must end it."""
    args = [*map(str, args)]
    return preloaded.start_muloco(args, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def launched_ranks(launcher) -> dict[int, psutil.Process]:
    """The `muloco train` processes under a running `muloco launch`, by LOCAL_RANK (the launcher's process
    index). They are forked from the launcher's preloaded server, whose title for each leads with its rank
    (`LOCAL_RANK=1 RANK=1 python -m muloco train ...`, muloco/net/preloaded.py); a plain process (the
    server's fallback) has it in its environment."""
    found = {}  # pid -> (local rank, process)
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            words = proc.cmdline()
            if not {"muloco", "train"} <= set(words):
                continue
            titled = dict(w.split("=", 1) for w in words[:2] if w.startswith(("LOCAL_RANK=", "RANK=")))
            local_rank = titled.get("LOCAL_RANK") or proc.environ().get("LOCAL_RANK")
        except psutil.NoSuchProcess:
            continue
        if local_rank is not None:
            found[proc.pid] = (int(local_rank), proc)
    # A rank's own forks (hivemind's DHT and averagers) carry its title too: keep the topmost.
    return {rank: proc for rank, proc in found.values() if proc.ppid() not in found}


class LineReader:
    """Collects a process's stderr lines in the background (so a test can wait for one)."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append(line)

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in list(self.lines) if needle in line), None)
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"no line with {needle!r} within {timeout} s")


def run_rank_scripts(script: str, world_size: int, out: Path, timeout: float) -> None:
    """Run `script` as R rank processes (argv: rank, world size, a free port, out); every one ends
    (killed at the latest) before this returns, and each must exit 0 (its log is in the failure)."""
    from muloco.net.launch import free_port

    port = str(free_port())
    tests = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    # R processes on 2 cores, one thread each; the script imports this module as pytest lets tests do.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tests}
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    procs = []
    try:
        # -X faulthandler: a rank that crashes in native code (SIGSEGV, SIGABRT) prints its Python stack.
        for rank, log in enumerate(logs):
            with open(log, "w") as sink:  # a file, not a pipe: a chatty rank cannot block on a full pipe
                cmd = [
                    sys.executable,
                    "-X",
                    "faulthandler",
                    script,
                    str(rank),
                    str(world_size),
                    port,
                    str(out),
                ]
                procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    # Every failed rank's log: the first to fail is often not rank 0 (the others then see a reset peer).
    failed = [
        f"rank {r} (exit {p.returncode}):\n{log.read_text()[-2000:]}"
        for r, (p, log) in enumerate(zip(procs, logs, strict=True))
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)


COMBO_RANK = Path(__file__).resolve().parent / "combo_rank.py"


def run_combo_ranks(
    backend: str, K: int, cases: list[dict], tmp_path: Path, config: str, timeout: float
) -> None:
    """K processes of combo_rank.py, each running every case in turn as a rank of `backend` (torch, hivemind
    and torchft imported once per process, not once per case); tmp_path holds the plan, rendezvous and logs.
    Every process ends with the test (killed on timeout); a case that failed on a rank fails here."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": config, "cases": cases}))
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    logs = [tmp_path / f"rank{r}.log" for r in range(K)]
    # Each process its share of the cores, as `muloco launch` gives it (torch's default oversubscribes).
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // K)), **os.environ}
    procs = []
    try:
        for r in range(K):
            with open(logs[r], "w") as log:
                # Forked from the preloaded server (torch imported once, not once per rank: ~4 CPU-s each).
                args = [backend, str(r), str(K), str(plan), str(rendezvous)]
                procs.append(
                    preloaded.start_script(
                        COMBO_RANK, args, env=env, stdout=log, stderr=log, die_with_parent=True
                    )
                )
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for case in cases:
        for r in range(K):
            rc = rendezvous / f"{case['name']}.rank{r}.rc"
            code = rc.read_text() if rc.exists() else "no exit code"
            assert code == "0", f"{case['name']} rank {r}: {code}\n{logs[r].read_text()[-4000:]}"


def combo_run_dirs(backend: str, name: str, tmp_path: Path, K: int) -> list[Path]:
    """A combo case's run directories: one for torch's world, one per hivemind peer or torchft worker."""
    if backend == "torch":
        return [tmp_path / name]  # one run directory for the world (rank 0 writes summary.json)
    suffix = "peer" if backend == "hivemind" else "worker"
    return [tmp_path / f"{name}-{suffix}{r}" for r in range(K)]


def launch_and_interrupt(*args, after_s: float = 1.0, timeout: float = 120) -> tuple[int, str]:
    """`muloco launch ARGS` (with logging.progress=lines), SIGINT `after_s` after rank 0's first eval line
    (training has started); its exit code and stderr. The launcher is killed at the latest on leaving."""
    launcher = start_muloco("launch", *args)
    try:
        line = launcher.stdout.readline()
        assert line.startswith("[rank 0] kind=eval"), line
        time.sleep(after_s)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=timeout)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    return launcher.returncode, err


class DelayedNesterovByHand:
    """Liu et al. 2024's Algorithm 3 (arXiv 2401.09135; c = 0) written out over fp32 tensors: every arrival
    theta -= lr g / N; every N-th also m <- beta m + (the last N arrivals' sum) / N and theta -= lr beta m."""

    def __init__(self, theta: list[torch.Tensor], lr: float, beta: float, every: int) -> None:
        self.theta, self.lr, self.beta, self.every = theta, lr, beta, every
        self.m = [torch.zeros_like(p) for p in theta]
        self.window_sum = [torch.zeros_like(p) for p in theta]
        self.arrivals = 0

    def arrive(self, g: list[torch.Tensor]) -> None:
        self.arrivals += 1
        folds = self.arrivals % self.every == 0
        for i, gi in enumerate(g):
            self.window_sum[i] += gi
            if folds:
                self.m[i] = self.beta * self.m[i] + self.window_sum[i] / self.every
            self.theta[i] -= self.lr * (gi / self.every + (self.beta * self.m[i] if folds else 0))
        if folds:
            self.window_sum = [torch.zeros_like(p) for p in self.theta]
