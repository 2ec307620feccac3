"""Sweeps: a grid of `muloco train` runs from one YAML file, resumable, with DP baselines and a report.

A sweep file (docs/sweeps.md)::

    name: inner_optimizers              # default: the file's stem
    base: ../quickstart.yaml            # the base config, relative to this file
    output_dir: runs/sweeps/inner_optimizers   # default: runs/sweeps/<name>, relative to the working dir
    fixed: {logging.progress: lines}    # overrides applied to every run
    grid:                               # dotted key -> list of values; the runs are the product
      inner.optimizer: [adamw, muon]
      workers: [1, 2, 4, 8]
    zip: [[compression.bits, compression.error_feedback]]  # keys whose lists advance together
    exclude: [{inner.optimizer: adamw, workers: 8}]       # drop runs that match every key of a rule
    baselines: auto                     # add the DP run of each DiLoCo/MuLoCo run (deduplicated)

The files, each importing only the ones above it:

- `spec.py`: the sweep file's schema; `parse_sweep` (file -> `SweepSpec`, every malformation a
  `ConfigError`), `load_sweep`.
- `expand.py`: pure functions; `expand_grid` (grid + zip + exclude -> assignments),
  `dp_baseline_assignment`, `run_names`.
- `plan.py`: `plan_sweep` validates every run's config up front (a typo fails the sweep before anything
  runs) -> `PlannedRun`s; `override_text` finds the KEY=VALUE that `muloco train` reads back exactly.
- `runner.py`: `run_sweep` runs the plan, J subprocesses at a time, skipping runs whose summary.json says
  `completed`; Ctrl+C / SIGTERM stop the runs after their current round.
- `main.py`: `sweep_main`, the `muloco sweep` command: plan, `--dry-run` listing (`describe_plan`), run,
  then the report (summary.csv, report.md, plots; muloco.tools.report).
"""

from muloco.sweep.expand import dp_baseline_assignment, expand_grid, run_names
from muloco.sweep.main import describe_plan, sweep_main
from muloco.sweep.plan import PlannedRun, override_text, plan_sweep
from muloco.sweep.runner import SweepResult, run_status, run_sweep
from muloco.sweep.spec import SweepSpec, load_sweep, parse_sweep

__all__ = [
    "PlannedRun",
    "SweepResult",
    "SweepSpec",
    "describe_plan",
    "dp_baseline_assignment",
    "expand_grid",
    "load_sweep",
    "override_text",
    "parse_sweep",
    "plan_sweep",
    "run_names",
    "run_status",
    "run_sweep",
    "sweep_main",
]
