"""`muloco report DIR`: tables and plots from the run directories under DIR (a sweep's, or any).

Reads every `DIR/*/summary.json` with its `config.yaml` and `metrics.jsonl`, and writes into DIR:

- `summary.csv`: one row per run: the config keys that differ across the runs, every summary.json field,
  the run's DP baseline and its % over it: (final_val_loss / dp_final_val_loss - 1) x 100.
- `report.md`: one table per inner optimizer, the best DiLoCo/MuLoCo run of each in bold, and the plots.
- PNGs: val loss vs tokens; % over DP vs K (workers); loss vs bits with and without error feedback; loss
  vs H (sync.every). A plot the runs have no data for is skipped, and report.md says why.
- With a tune spec (a sweep's `tune:`, recorded in DIR/sweep.json, or `--tune-over/--tune-per`): the tuned
  comparison (muloco/tools/tuning.py) as a table in report.md, `tuned.json`, and the gap to DP against K
  with the seeds' range as error bars (`tuned_gap_vs_workers.png`).

The parts: runs.py reads the run directories into records and gives each run its DP baseline;
report_tables.py writes summary.csv and report.md, report_plots.py the PNGs, tuning.py the tuned comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

from muloco.errors import UserError
from muloco.tools import tuning
from muloco.tools.report_plots import make_plots, tuned_plot
from muloco.tools.report_tables import order_runs, write_csv, write_markdown
from muloco.tools.runs import RunRecord, find_baseline, load_runs, pct_over, varied_keys
from muloco.tools.tuning import TuneSpec

# What a sweep records beside its runs for the report (its tune spec): muloco/sweep/main.py writes it.
SWEEP_RECORD = "sweep.json"


def recorded_tune(directory: Path) -> TuneSpec | None:
    """The tune spec a sweep recorded in DIR/sweep.json, or None (no record, or a sweep without tune:)."""
    try:
        record = json.loads((directory / SWEEP_RECORD).read_text(encoding="utf-8"))
        tune = record["tune"]
        return None if tune is None else TuneSpec(tuple(tune["over"]), tuple(tune.get("per", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_tune(spec: TuneSpec, runs: list[RunRecord], directory: Path) -> None:
    """Every tuned and per key is a config key of the runs: a typo is one line, not an empty table."""
    known = {k for run in runs for k in run.config}
    for key in (*spec.over, *spec.per):
        if key not in known:
            raise UserError(
                f"report: tune key {key!r} is not a config key of the runs under {directory}; "
                "use dotted config keys, e.g. --tune-over inner.lr --tune-per inner.optimizer,workers"
            )
    both = sorted(set(spec.over) & set(spec.per))
    if both:
        raise UserError(f"report: {both[0]} is both tuned over and tuned per; keep it in one of them")


def build_report(directory: str | Path, tune: TuneSpec | None = None) -> dict[str, Path]:
    """Write summary.csv, report.md and the PNGs into directory (and tuned.json with a tune spec: the one
    given, else the one a sweep recorded there); returns their paths by file name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(
            f"report: {directory} is not a directory; pass a sweep directory or a runs/ directory"
        )
    runs = load_runs(directory)
    if not runs:
        raise UserError(f"report: no run directories with a summary.json under {directory}; check the path")
    tune = tune or recorded_tune(directory)
    if tune is not None:
        check_tune(tune, runs, directory)
    for run in runs:
        run.baseline = find_baseline(run, runs)
        if run.baseline is not None and run.loss is not None:
            run.pct_over_dp = pct_over(run.loss, run.baseline.loss)
    keys = varied_keys(runs)
    groups = order_runs(runs, keys)
    ordered = [r for members in groups.values() for r in members]
    write_csv(ordered, keys, directory / "summary.csv")
    plot_status = make_plots(ordered, keys, directory)
    tuned = None
    outputs = {"summary.csv": directory / "summary.csv", "report.md": directory / "report.md"}
    if tune is not None:
        comparisons = tuning.order(tuning.compare(tuning.tune(runs, keys, tune)), tune)
        tuned = (tune, comparisons)
        (directory / "tuned.json").write_text(
            json.dumps(tuning.as_json(comparisons, tune), indent=1, default=str) + "\n", encoding="utf-8"
        )
        outputs["tuned.json"] = directory / "tuned.json"
        plot_status["tuned_gap_vs_workers.png"] = tuned_plot(comparisons, directory)
    write_markdown(directory, groups, keys, plot_status, directory / "report.md", tuned)
    outputs.update({name: directory / name for name, skipped in plot_status.items() if skipped is None})
    return outputs
