"""The report's tables: summary.csv (every run's varied settings and summary fields, its DP baseline and
its % over it) and report.md (a table per inner optimizer, the tuned comparison, the plots or why each was
skipped)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from muloco.tools import tuning
from muloco.tools.report_plots import PLOTS
from muloco.tools.runs import RunRecord, canonical, value_text
from muloco.tools.tuning import TuneSpec


def _sort_value(value: Any) -> tuple:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, canonical(value))


def order_runs(runs: list[RunRecord], keys: list[str]) -> dict[str, list[RunRecord]]:
    """Runs grouped by inner optimizer (groups sorted); in a group the DP runs first, then by the varied
    keys' values (numbers numerically)."""
    groups: dict[str, list[RunRecord]] = {}
    for run in sorted(runs, key=lambda r: r.group):
        groups.setdefault(run.group, []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: (not r.is_dp, [_sort_value(r.config.get(k)) for k in keys], r.name))
    return groups


def write_csv(runs: list[RunRecord], keys: list[str], path: Path) -> None:
    fields = [k for k in dict.fromkeys(k for run in runs for k in run.summary) if k not in keys]
    header = ["run", *keys, *fields, "dp_baseline", "pct_over_dp"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for run in runs:
            values = [run.config.get(k) for k in keys] + [run.summary.get(k) for k in fields]
            writer.writerow(
                [
                    run.name,
                    *(_csvvalue_text(v) for v in values),
                    run.baseline.name if run.baseline else "",
                    "" if run.pct_over_dp is None else f"{run.pct_over_dp:.4f}",
                ]
            )


def _csvvalue_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _table(runs: list[RunRecord], keys: list[str]) -> list[str]:
    keys = [k for k in keys if k != "inner.optimizer"]
    header = [
        "run",
        *keys,
        "final val loss",
        "% over DP",
        "MB sent / worker",
        "DDP bytes / sent",
        "bits / param",
    ]
    header += ["tokens", "wall s", "status"]
    lines = ["| " + " | ".join(f"`{h}`" if h in keys else h for h in header) + " |"]
    lines.append("|" + "---|" * len(header))
    eligible = [r for r in runs if not r.is_dp and r.completed and r.loss is not None]
    best = min(eligible, key=lambda r: r.loss) if eligible else None
    for run in runs:
        s = run.summary
        sent, ddp = s.get("bytes_sent_per_worker"), s.get("bytes_ddp_equivalent")
        cells = [
            run.name,
            *(value_text(run.config.get(k)) for k in keys),
            "" if run.loss is None else f"{run.loss:.4f}",
            "" if run.pct_over_dp is None else f"{run.pct_over_dp:+.2f}%",
            "" if not isinstance(sent, int | float) else f"{sent / 1e6:.2f}",
            f"{ddp / sent:.1f}x"
            if isinstance(sent, int | float) and sent and isinstance(ddp, int | float)
            else "",
            value_text(s.get("effective_bits_per_param")),
            value_text(s.get("tokens_seen")),
            "" if not isinstance(s.get("wall_time_s"), int | float) else f"{s['wall_time_s']:.0f}",
            str(s.get("status", "")),
        ]
        if run is best:
            cells[0] = f"**{cells[0]}**"
            cells[len(keys) + 1] = f"**{cells[len(keys) + 1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(
    directory: Path,
    groups: dict[str, list[RunRecord]],
    keys: list[str],
    plots: dict[str, str | None],
    path: Path,
    tuned: tuple[TuneSpec, list[tuning.Comparison]] | None = None,
) -> None:
    runs = [r for members in groups.values() for r in members]
    statuses: dict[str, int] = {}
    for run in runs:
        statuses[str(run.summary.get("status"))] = statuses.get(str(run.summary.get("status")), 0) + 1
    lines = [
        f"# Report: {directory.name}",
        "",
        f"{len(runs)} runs in `{directory}` ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}).",
        f"Settings that differ across runs: {', '.join(f'`{k}`' for k in keys) or 'none'}.",
        "",
        "% over DP = (final val loss / final val loss of the DP baseline - 1) x 100, lower is better; the DP "
        "baseline is the `method: dp` run with the same inner optimizer and tokens (the same `workers` if "
        "there is one). **Bold**: each inner optimizer's best DiLoCo/MuLoCo run. DDP bytes / sent: how many "
        "times fewer bytes each worker sent than data-parallel training's ring all-reduce would have.",
    ]
    failed = [r.name for r in runs if not r.completed]
    if failed:
        lines += ["", f"Not completed: {', '.join(failed)} (see each run's train.log)."]
    if tuned is not None:
        spec, comparisons = tuned
        lines += [
            "",
            "## Tuned comparison",
            "",
            f"Tuned over {', '.join(f'`{k}`' for k in spec.over)}"
            + (f", per {', '.join(f'`{k}`' for k in spec.per)}" if spec.per else "")
            + ". Each row: the DiLoCo/MuLoCo setting with the lowest mean final val loss over the seeds "
            "all its candidates ran, against the DP baseline at its own best setting; final val losses are "
            "means over the seeds both ran, and the gap to DP is the mean over those seeds of (loss / DP "
            "loss - 1) x 100, with its range over them. A best value at the edge of what was tried is "
            "flagged: the optimum may lie outside the grid.",
            "",
            *tuning.markdown(comparisons, spec),
        ]
    for group, members in groups.items():
        lines += ["", f"## inner optimizer: {group}", "", *_table(members, keys)]
    lines += ["", "## Plots", ""]
    for name, skipped in plots.items():
        if skipped is None:
            lines += [f"![{PLOTS[name]}]({name})", ""]
    for name, skipped in plots.items():
        if skipped is not None:
            lines.append(f"- skipped `{name}` ({PLOTS[name]}): {skipped}")
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
