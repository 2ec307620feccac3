"""Running a plan: `run_sweep` starts `muloco train` subprocesses, J at a time, skips runs whose
summary.json says `completed` (so a rerun resumes), keeps going past failed runs, and on Ctrl+C or SIGTERM
stops the running ones after their current round."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from muloco.net.preloaded import PreloadedProcess, start_muloco
from muloco.sweep.plan import PlannedRun
from muloco.sweep.spec import SweepSpec, _canonical, _flatten

log = logging.getLogger("muloco")


def run_status(run_dir: Path) -> str:
    """completed | failed | interrupted (from summary.json), or `new` when there is none yet."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("status", "failed"))
    except FileNotFoundError:
        return "new"
    except (OSError, json.JSONDecodeError, AttributeError):
        return "failed"


def start_process(spec: SweepSpec, run: PlannedRun, log_path: Path) -> PreloadedProcess | subprocess.Popen:
    """Start `muloco train` for one run, stdout and stderr appended to log_path, forked from the preloaded
    server (muloco/net/preloaded.py: each run spares torch's import). It gets its own session, so a Ctrl+C
    reaches it once, forwarded by the sweep (a second SIGINT would make it skip its final checkpoint)."""
    env = dict(os.environ)
    threads = run.config.train.threads
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(f"=== muloco sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(run.overrides)}\n")
        log_file.flush()
        args = ["train", str(spec.base), *run.overrides]
        if run.config.dp.comm_hook != "none":  # torch's DDP: one process per worker
            args = ["launch", "--nproc", str(run.config.workers), str(spec.base), *run.overrides]
        return start_muloco(args, env=env, stdout=log_file, stderr=subprocess.STDOUT, new_session=True)


@dataclass
class SweepResult:
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # run name -> why


Launcher = Callable[[SweepSpec, PlannedRun, Path], Any]  # returns a Popen-like: poll(), wait(), send_signal()


def run_sweep(
    spec: SweepSpec, runs: list[PlannedRun], jobs: int, launch: Launcher | None = None, poll_s: float = 0.5
) -> SweepResult:
    """Run every run not yet completed, `jobs` at a time. A failed run does not stop the others."""
    launch = launch or start_process
    result = SweepResult()
    pending = []
    for run in runs:
        if run_status(run.run_dir) == "completed":
            result.skipped.append(run.name)
            changed = _changed_key(run)
            if changed:
                log.warning(
                    "run=%s completed with a different %s than the sweep now asks for; it is kept as it is "
                    "(delete %s to run it again)",
                    run.name,
                    changed,
                    run.run_dir,
                )
        else:
            pending.append(run)
    log.info(
        "sweep=%s runs=%d completed_before=%d to_run=%d jobs=%d dir=%s",
        spec.name,
        len(runs),
        len(result.skipped),
        len(pending),
        jobs,
        spec.output_dir,
    )
    active: dict[str, tuple[PlannedRun, Any, float]] = {}
    total, started = len(pending), 0
    previous_term = _sigterm_as_interrupt()
    try:
        while pending or active:
            while pending and len(active) < jobs:
                run = pending.pop(0)
                run.run_dir.mkdir(parents=True, exist_ok=True)
                started += 1
                log.info("start run=%s (%d/%d) log=%s", run.name, started, total, run.run_dir / "train.log")
                active[run.name] = (run, launch(spec, run, run.run_dir / "train.log"), time.perf_counter())
            for name, (run, proc, t0) in list(active.items()):
                code = proc.poll()
                if code is not None:
                    del active[name]
                    _finish(run, code, time.perf_counter() - t0, result)
            if active:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        # Each child checkpoints at the end of its round and exits; wait for them so no run is left torn.
        log.info("sweep interrupted: stopping %d running run(s) after their current round", len(active))
        for _, proc, _ in active.values():
            proc.send_signal(signal.SIGINT)
        for _, proc, _ in active.values():
            try:
                proc.wait()
            except KeyboardInterrupt:  # a second Ctrl+C: leave at once (they keep their last checkpoint)
                for _, other, _ in active.values():
                    other.send_signal(signal.SIGINT)
                break
        raise
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    return result


def _sigterm_as_interrupt():
    """SIGTERM stops the sweep like Ctrl+C: the runs live in their own sessions, so without this a killed
    sweep would leave them training (and a rerun would start a second process on the same run dir)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave SIGTERM alone
        return None


def _changed_key(run: PlannedRun) -> str | None:
    """The first setting (dotted key) in which a finished run's config.yaml differs from the plan."""
    try:
        done = yaml.safe_load((run.run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(done, dict):
        return None
    ignore = ("run.name", "run.output_dir", "logging.", "checkpoint.", "train.threads")
    old, new = _flatten(done), _flatten(run.config.to_dict())
    for key in sorted(set(old) | set(new)):
        if not key.startswith(ignore) and _canonical(old.get(key)) != _canonical(new.get(key)):
            return key
    return None


def _finish(run: PlannedRun, code: int, seconds: float, result: SweepResult) -> None:
    status = run_status(run.run_dir)
    result.ran.append(run.name)
    if code == 0 and status == "completed":
        summary = json.loads((run.run_dir / "summary.json").read_text(encoding="utf-8"))
        log.info(
            "end run=%s status=completed final_val_loss=%s wall_s=%.0f",
            run.name,
            summary.get("final_val_loss"),
            seconds,
        )
        return
    why = f"exit code {code}, status {status}; see {run.run_dir / 'train.log'}"
    result.failed[run.name] = why
    log.info("end run=%s status=failed (%s)", run.name, why)
