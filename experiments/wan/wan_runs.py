"""The runs of the WAN headline (bench_wan.py): loss curves on loopback, timings over the testbed's links.

Curves: a row's loss does not depend on the link (torch's collectives reduce in the same order on loopback
as over the testbed), so each row's horizons are trained once, on loopback (`muloco launch --nproc 4`),
to find the shortest horizon that reaches DDP's final loss (or one of them over the first link, which then
stands for its loopback run: keep_as_curve). Links: each row is then run over each link, the
low-communication rows in full at that horizon, the per-step rows (DDP and its hooks) for a window of steps
whose median step time, all-reduces included, times the steps they need gives their wall-clock (issue 36:
over a slow link their full runs would take hours).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from wan_rows import Row

from muloco.testbed.network import Testbed
from muloco.testbed.train import train_on_testbed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/pico.yaml")
WORKERS = 4
DECAY = 0.2  # wsd: the decay fills the last 20% of each horizon (Hägele et al. 2024)


def run_overrides(
    row: Row, steps: int, batch_tokens: int, name: str, out: Path, eval_every: int
) -> list[str]:
    return [
        *row.overrides,
        f"workers={WORKERS}",
        f"run.name={name}",
        f"run.output_dir={out}",
        f"train.total_tokens={steps * batch_tokens}",
        "train.lr_schedule=wsd",
        f"train.decay_fraction={DECAY}",
        f"train.eval_every={eval_every}",
        "checkpoint.resume=never",
        "logging.progress=off",
    ]


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    # train_s: the training rounds' clock, evaluations left out (absent in runs before it existed)
    evals = [
        {"step": r["step"], "time_s": r["time_s"], "train_s": r.get("train_s"), "val_loss": r["val_loss"]}
        for r in records
        if r["kind"] == "eval"
    ]
    trains = [(r["step"], r["time_s"]) for r in records if r["kind"] == "train"]
    return {"summary": summary, "evals": evals, "trains": trains}


def completed_curve(row: Row, steps: int, batch_tokens: int, workdir: Path, eval_every: int) -> dict | None:
    """The completed loopback run of `row` for `steps` in `workdir` with the same overrides, or None."""
    name = f"{row.key}_{steps}"
    args_file = workdir / f"{name}.args.json"
    overrides = run_overrides(row, steps, batch_tokens, name, workdir, eval_every)
    if not args_file.exists() or not _same_run(json.loads(args_file.read_text()), overrides):
        return None
    try:
        done = read_run(workdir / name)
    except FileNotFoundError:
        return None
    return done if done["summary"].get("status") == "completed" else None


def loopback_curve(
    row: Row, steps: int, batch_tokens: int, workdir: Path, eval_every: int, reuse: bool = False
) -> dict:
    """`steps` inner steps of `row` (its torch twin) in K local processes; its evals and summary. reuse:
    a completed run of the same overrides in `workdir` is read instead (the runs are deterministic)."""
    name = f"{row.key}_{steps}"
    overrides = run_overrides(row, steps, batch_tokens, name, workdir, eval_every)
    args_file = workdir / f"{name}.args.json"
    if reuse and (done := completed_curve(row, steps, batch_tokens, workdir, eval_every)) is not None:
        return done
    shutil.rmtree(workdir / name, ignore_errors=True)
    args_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "muloco", "launch", "--nproc", str(WORKERS), CONFIG, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed on loopback: {done.stderr.strip().splitlines()[-1:]}")
    args_file.write_text(json.dumps(overrides))
    return read_run(workdir / name)


def keep_as_curve(
    row: Row, steps: int, batch_tokens: int, link_run: dict, workdir: Path, eval_every: int
) -> None:
    """Record a torch row's run over a link as its loopback run of `steps` in `workdir` (its losses are the
    loopback run's, bit for bit), so that completed_curve and --reuse-curves find it like any other."""
    name = f"{row.key}_{steps}"
    shutil.rmtree(workdir / name, ignore_errors=True)
    (workdir / name).mkdir(parents=True)
    for file in ("metrics.jsonl", "summary.json"):
        shutil.copy2(link_run["run_dir"] / file, workdir / name / file)
    overrides = run_overrides(row, steps, batch_tokens, name, workdir, eval_every)
    (workdir / f"{name}.args.json").write_text(json.dumps(overrides))


def _same_run(saved: list[str], overrides: list[str]) -> bool:
    """The same run's overrides, wherever its directory was then (a workdir copied or moved)."""

    def where_not(args: list[str]) -> list[str]:
        return [a for a in args if not a.startswith("run.output_dir=")]

    return where_not(saved) == where_not(overrides)


def first_at_or_below(evals: list[dict], target: float) -> dict | None:
    return next((e for e in evals if e["val_loss"] <= target), None)


def on_link(
    testbed: Testbed,
    row: Row,
    steps: int,
    batch_tokens: int,
    workdir: Path,
    eval_every: int,
    window: int | None,
) -> dict:
    """`row` over the testbed: `steps` inner steps (a window of `window` steps for a per-step row, logged
    every step, no evaluations). Its evals, summary, wire bytes and, for a window, its median step time."""
    length = window + row.warmup_steps if window else steps
    name = f"{row.key}_{length}{'w' if window else ''}_{testbed.rate_mbit:g}mbit_{testbed.delay_ms:g}ms"
    for old in workdir.glob(f"{name}*"):
        shutil.rmtree(old)
    overrides = run_overrides(row, length, batch_tokens, name, workdir, 0 if window else eval_every)
    if window:
        overrides.append("train.log_every=1")
    restart = None
    if row.kill_at is not None:  # after this many of its syncs (H = 15)
        restart = max(1, round(row.kill_at * steps / 15))
    started = time.perf_counter()
    run = train_on_testbed(
        testbed, CONFIG, overrides, workdir / f"{name}.logs", row.backend, 5400, restart_after_syncs=restart
    )
    if not run.ok:
        raise RuntimeError(f"{name} failed (exit codes {run.returncodes}); see {run.logs}")
    first = {"torch": name, "hivemind": f"{name}-peer0", "torchft": f"{name}-worker0"}[row.backend]
    result = read_run(workdir / first)
    result["run_dir"] = workdir / first
    result["wire_bytes_per_worker"] = sum(run.wire_sent) / len(run.wire_sent)
    result["process_wall_s"] = round(run.wall_s, 1)
    result["harness_s"] = round(time.perf_counter() - started, 1)
    if window:
        steps_s = [b[1] - a[1] for a, b in zip(result["trains"], result["trains"][1:], strict=False)]
        timed = steps_s[row.warmup_steps - 1 :]  # steps_s[i] is step i + 2's
        result["step_s_median"] = statistics.median(timed)
        result["step_s_spread"] = [min(timed), max(timed)]
        result["window_steps"] = len(timed)
    return result
