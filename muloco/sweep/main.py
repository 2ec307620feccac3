"""`muloco sweep FILE [--jobs J] [--dry-run]`: plan (validating every run), list the plan or run what is not
completed, then write the report (summary.csv, report.md, plots; muloco.tools.report)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from muloco.errors import UserError
from muloco.run.run_dir import write_json_atomic
from muloco.sweep.plan import PlannedRun, plan_sweep
from muloco.sweep.runner import run_status, run_sweep
from muloco.sweep.spec import SweepSpec, load_sweep
from muloco.tools.report import SWEEP_RECORD

log = logging.getLogger("muloco")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def describe_plan(spec: SweepSpec, runs: list[PlannedRun]) -> str:
    """The --dry-run listing: one line per run with its status and varied overrides, then the shared ones."""
    lines = [
        f"sweep {spec.name}: {len(runs)} runs ({sum(r.baseline for r in runs)} DP baselines) in "
        f"{spec.output_dir}, base {spec.base}",
    ]
    shared = [o for o in runs[0].overrides if all(o in r.overrides for r in runs)]
    width = max(len(r.name) for r in runs)
    for run in runs:
        own = [o for o in run.overrides if o not in shared and not o.startswith("run.name=")]
        lines.append(f"  {run.name:<{width}}  {run_status(run.run_dir):<11}  {' '.join(own)}")
    lines.append(f"every run: muloco train {spec.base} {' '.join(shared)} run.name=<name>")
    return "\n".join(lines)


def sweep_record(spec: SweepSpec) -> dict:
    """What `muloco report DIR` reads back from the sweep's directory: which file made it, what it tuned."""
    return {
        "name": spec.name,
        "sweep_file": str(spec.path),
        "tune": spec.tune.as_dict() if spec.tune is not None else None,
    }


def sweep_main(path: str | Path, jobs: int = 1, dry_run: bool = False) -> int:
    """`muloco sweep`: plan (validating every run), run what is not completed, write the report."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {jobs}")
    spec = load_sweep(path)
    threads = max(1, cpu_count() // jobs)
    runs = plan_sweep(spec, threads)
    if dry_run:
        print(describe_plan(spec, runs))
        return 0
    spec.output_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(spec.output_dir / SWEEP_RECORD, sweep_record(spec))
    result = run_sweep(spec, runs, jobs)

    from muloco.tools.report import build_report  # matplotlib is slow to import: only when a report is due

    try:
        log.info("report=%s", build_report(spec.output_dir, spec.tune)["report.md"])
    except UserError as exc:  # e.g. no run got as far as a summary.json: say so, then list the failures
        log.info("no report: %s", exc)
    done = len(runs) - len(result.failed)
    if result.failed:
        names = ", ".join(f"{name} ({why})" for name, why in result.failed.items())
        log.info("sweep=%s completed=%d failed=%d: %s", spec.name, done, len(result.failed), names)
        return 1
    log.info("sweep=%s completed=%d/%d dir=%s", spec.name, done, len(runs), spec.output_dir)
    return 0
