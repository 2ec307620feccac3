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

A run's DP baseline is the completed `method: dp` run with the same inner optimizer, tokens seen and
settings DP uses (model, data, inner, train budget); one with the same `workers` (the same data shards) is
preferred. Without one, it is the best (lowest final loss) DP run that differs from it only in its lrs
(`inner.lr`, `inner.adamw.lr`): the tuned baseline, so each method can run at its own tuned lr.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from muloco.errors import UserError
from muloco.run.metrics import read_jsonl
from muloco.tools import tuning
from muloco.tools.tuning import TuneSpec

# Config keys that never tell runs apart in a report (names, places, logging, threads).
IGNORED_PREFIXES = ("run.name", "run.output_dir", "logging.", "checkpoint.", "train.threads")
# Keys a DP run ignores, or that may differ between a run and its DP baseline.
DP_FREE_PREFIXES = ("method", "workers", *tuning.DP_BASELINE_FREE_PREFIXES)
# The inner lrs: a run without a DP run at its own lr is compared with the best DP run over these.
LR_KEYS = ("inner.lr", "inner.adamw.lr")

PLOTS = {
    "loss_vs_tokens.png": "validation loss vs tokens, per inner optimizer",
    "pct_over_dp_vs_workers.png": "% over the DP baseline vs K (workers), per inner optimizer",
    "loss_vs_bits.png": "final validation loss vs bits per pseudogradient entry, with and without EF",
    "loss_vs_sync_every.png": "final validation loss vs H (sync.every)",
    "tuned_gap_vs_workers.png": "% over DP vs K, each method and its DP at their own best setting",
}
# What a sweep records beside its runs for the report (its tune spec): muloco/sweep/main.py writes it.
SWEEP_RECORD = "sweep.json"


@dataclass
class RunRecord:
    """One run directory: its summary.json, its config.yaml flattened to dotted keys, its eval curve."""

    name: str
    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    evals: list[tuple[int, float]] = field(default_factory=list)  # (tokens, val_loss)
    baseline: RunRecord | None = None
    pct_over_dp: float | None = None

    @property
    def group(self) -> str:
        return str(self.summary.get("inner_optimizer") or self.config.get("inner.optimizer") or "?")

    @property
    def is_dp_method(self) -> bool:
        """method: dp, with or without a DDP communication hook."""
        return (self.summary.get("method") or self.config.get("method")) == "dp"

    @property
    def is_dp(self) -> bool:
        """The DP baseline: method dp with uncompressed gradients. A dp.comm_hook run (bf16, PowerSGD) is
        a method compared against it, like DiLoCo."""
        return self.is_dp_method and self.config.get("dp.comm_hook", "none") == "none"

    @property
    def loss(self) -> float | None:
        value = self.summary.get("final_val_loss")
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def acting_settings(flat: dict[str, Any]) -> dict[str, Any]:
    """A run's flattened config without the keys that do not act on it, so that runs written before such
    a key existed compare equal to runs that carry its default: train.decay_fraction acts only with
    lr_schedule wsd, dp.* only with a comm hook (dp.powersgd_* only with powersgd)."""
    hook = flat.get("dp.comm_hook", "none")
    return {
        key: value
        for key, value in flat.items()
        if not (key == "train.decay_fraction" and flat.get("train.lr_schedule") != "wsd")
        and not (key.startswith("dp.") and hook == "none")
        and not (key.startswith("dp.powersgd_") and hook != "powersgd")
    }


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def load_runs(directory: Path) -> list[RunRecord]:
    """Every `directory/*/summary.json`, sorted by directory name; an unreadable one is skipped."""
    runs = []
    for summary_path in sorted(directory.glob("*/summary.json")):
        run_dir = summary_path.parent
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(summary, dict):
            continue
        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            config = None
        evals: dict[int, float] = {}
        for record in read_jsonl(run_dir / "metrics.jsonl"):
            if record.get("kind") == "eval" and isinstance(record.get("val_loss"), int | float):
                evals[int(record.get("tokens", 0))] = float(record["val_loss"])
        runs.append(
            RunRecord(
                run_dir.name,
                run_dir,
                summary,
                acting_settings(_flatten(config)) if isinstance(config, dict) else {},
                sorted(evals.items()),
            )
        )
    return runs


def varied_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose values differ across the runs, in config order (names and places left out)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config))
    return [
        key
        for key in keys
        if not key.startswith(IGNORED_PREFIXES)
        and len({_canonical(run.config.get(key)) for run in runs if run.config}) > 1
    ]


def pct_over(loss: float, dp_loss: float) -> float:
    """How much worse than DP, in percent: (loss / dp_loss - 1) x 100 (the MuLoCo paper's measure)."""
    return (loss / dp_loss - 1.0) * 100.0


def find_baseline(run: RunRecord, runs: list[RunRecord]) -> RunRecord | None:
    """The run's DP baseline (module docstring), or None."""
    if run.is_dp:
        return None

    def dp_settings(r: RunRecord, free: tuple[str, ...] = ()) -> dict[str, Any]:
        return {
            k: _canonical(v)
            for k, v in r.config.items()
            if not k.startswith(IGNORED_PREFIXES) and not k.startswith((*DP_FREE_PREFIXES, *free))
        }

    def matching(free: tuple[str, ...]) -> list[RunRecord]:
        return [
            r
            for r in runs
            if r.is_dp
            and r.completed
            and r.loss is not None
            and r.group == run.group
            and r.summary.get("tokens_seen") == run.summary.get("tokens_seen")
            and (not r.config or not run.config or dp_settings(r, free) == dp_settings(run, free))
        ]

    candidates = matching(())
    if not candidates:  # the tuned DP baseline: the best DP run that differs only in its lrs
        candidates = sorted(matching(LR_KEYS), key=lambda r: r.loss)
    same_workers = [r for r in candidates if r.summary.get("workers") == run.summary.get("workers")]
    return (same_workers or candidates or [None])[0]


def _sort_value(value: Any) -> tuple:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, value, "")
    return (1, 0, _canonical(value))


def order_runs(runs: list[RunRecord], keys: list[str]) -> dict[str, list[RunRecord]]:
    """Runs grouped by inner optimizer (groups sorted); in a group the DP runs first, then by the varied
    keys' values (numbers numerically)."""
    groups: dict[str, list[RunRecord]] = {}
    for run in sorted(runs, key=lambda r: r.group):
        groups.setdefault(run.group, []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: (not r.is_dp, [_sort_value(r.config.get(k)) for k in keys], r.name))
    return groups


# --- files ------------------------------------------------------------------------------------------


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
                    *(_csv_cell(v) for v in values),
                    run.baseline.name if run.baseline else "",
                    "" if run.pct_over_dp is None else f"{run.pct_over_dp:.4f}",
                ]
            )


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|")


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
            *(_cell(run.config.get(k)) for k in keys),
            "" if run.loss is None else f"{run.loss:.4f}",
            "" if run.pct_over_dp is None else f"{run.pct_over_dp:+.2f}%",
            "" if not isinstance(sent, int | float) else f"{sent / 1e6:.2f}",
            f"{ddp / sent:.1f}x"
            if isinstance(sent, int | float) and sent and isinstance(ddp, int | float)
            else "",
            _cell(s.get("effective_bits_per_param")),
            _cell(s.get("tokens_seen")),
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


# --- plots ------------------------------------------------------------------------------------------


Series = dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]]
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def own_lr(run: RunRecord) -> Any:
    """The lr of the run's inner optimizer: inner.adamw.lr for AdamW, inner.lr for every other (under
    Muon, inner.adamw.lr only drives the embeddings, head and norms)."""
    return run.config.get("inner.adamw.lr" if run.group == "adamw" else "inner.lr")


def _series_key(run: RunRecord, keys: list[str], drop: tuple[str, ...]) -> tuple:
    """(inner optimizer, its own lr, then the values of the other varied keys not on the plot's axes).
    Under Muon a varied AdamW-side lr is kept as `adamw.lr`; under AdamW, Muon's lr means nothing."""
    skip = ("inner.optimizer", "method", *LR_KEYS)
    other = [(k, _cell(run.config.get(k))) for k in keys if k not in skip and not k.startswith(drop)]
    if run.group != "adamw" and "inner.adamw.lr" in keys:
        other.insert(0, ("adamw.lr", _cell(run.config.get("inner.adamw.lr"))))
    return run.group, (("lr", _cell(own_lr(run))), *other)


def _series(runs: list[RunRecord], keys: list[str], drop: tuple[str, ...], point) -> Series:
    """Points (x, y) = point(run) grouped by `_series_key`; only series with 2+ distinct x (a line, not a
    lone point) are kept."""
    out: Series = {}
    for run in runs:
        xy = point(run)
        if xy is not None:
            out.setdefault(_series_key(run, keys, drop), []).append(xy)
    return {key: points for key, points in out.items() if len({x for x, _ in points}) > 1}


def _styled(series: Series, groups: list[str], suffix: str = "", dashed: bool = False):
    """Labels naming only what tells the series apart; one colour per inner optimizer (as in the DP
    reference lines), one marker per series within it."""
    varying = {k for _, other in series for k, v in other if len({dict(o).get(k) for _, o in series}) > 1}
    varying.add("lr")  # every series names its inner optimizer's own lr
    lines: dict[str, list[tuple[float, float]]] = {}
    styles: dict[str, dict] = {}
    per_group: dict[str, int] = {}
    for (group, other), points in series.items():
        parts = [
            group,
            *(f"{k if k == 'adamw.lr' else k.split('.')[-1]}={v}" for k, v in other if k in varying),
        ]
        label = " ".join(parts) + suffix
        index = per_group[group] = per_group.get(group, -1) + 1
        lines[label] = points
        styles[label] = {
            "color": f"C{groups.index(group) % 10}",
            "marker": MARKERS[index % len(MARKERS)],
            "linestyle": "--" if dashed else "-",
        }
    return lines, styles


def _dp_references(runs: list[RunRecord], groups: list[str]) -> dict[str, tuple[float, str]]:
    """A dotted line at each inner optimizer's DP loss (its runs' baseline, if they share one)."""
    refs: dict[str, tuple[float, str]] = {}
    for group in groups:
        bases = {id(r.baseline): r.baseline for r in runs if r.group == group and r.baseline is not None}
        if len(bases) == 1:
            base = next(iter(bases.values()))
            refs[f"DP {group}"] = (base.loss, f"C{groups.index(group) % 10}")
    return refs


def make_plots(runs: list[RunRecord], keys: list[str], directory: Path) -> dict[str, str | None]:
    """Write the PNGs; returns each plot's name -> None (written) or why it was skipped."""
    from muloco.tools import plots

    done: dict[str, str | None] = {}
    groups = sorted({r.group for r in runs})
    diloco = [r for r in runs if not r.is_dp and r.loss is not None]

    curves: dict[str, list[plots.Curve]] = {}
    for run in sorted(runs, key=lambda r: (r.group, not r.is_dp, r.name)):
        if run.evals:
            tokens, losses = zip(*run.evals, strict=True)
            curves.setdefault(run.group, []).append((run.name, run.is_dp, list(tokens), list(losses)))
    if curves:
        plots.loss_vs_tokens(curves, directory / "loss_vs_tokens.png")
        done["loss_vs_tokens.png"] = None
    else:
        done["loss_vs_tokens.png"] = "no run has evaluations in metrics.jsonl"

    def workers_point(run: RunRecord):
        k = run.summary.get("workers")
        return (k, run.pct_over_dp) if run.pct_over_dp is not None and isinstance(k, int) else None

    lines, styles = _styled(_series(diloco, keys, ("workers",), workers_point), groups)
    if lines:
        plots.series_plot(
            lines,
            directory / "pct_over_dp_vs_workers.png",
            xlabel="K (workers)",
            ylabel="% over DP baseline (final val loss)",
            title="DiLoCo/MuLoCo vs data-parallel, by number of workers",
            styles=styles,
            references={"DP": (0.0, "black")},
            log2_x=True,
        )
        done["pct_over_dp_vs_workers.png"] = None
    else:
        done["pct_over_dp_vs_workers.png"] = "needs runs at 2+ worker counts, each with a DP baseline"

    done["loss_vs_bits.png"] = _bits_plot(diloco, keys, groups, directory, plots)

    def sync_point(run: RunRecord):
        h = run.summary.get("sync_every")
        return (h, run.loss) if isinstance(h, int) else None

    series = _series(diloco, keys, ("sync.",), sync_point)
    lines, styles = _styled(series, groups)
    if lines:
        plotted = [r for r in diloco if _series_key(r, keys, ("sync.",)) in series]
        plots.series_plot(
            lines,
            directory / "loss_vs_sync_every.png",
            xlabel="H (inner steps between syncs)",
            ylabel="final validation loss",
            title="Loss vs synchronization interval",
            styles=styles,
            references=_dp_references(plotted, groups),
            log2_x=True,
        )
        done["loss_vs_sync_every.png"] = None
    else:
        done["loss_vs_sync_every.png"] = "needs DiLoCo/MuLoCo runs at 2+ values of sync.every"
    return done


def _bits_plot(
    diloco: list[RunRecord], keys: list[str], groups: list[str], directory: Path, plots
) -> str | None:
    """Loss vs bits: solid lines without error feedback, dashed with it. The fp32 run (x = 32) has nothing
    for error feedback to resend, so it starts both lines."""
    lines: dict[str, list[tuple[float, float]]] = {}
    styles: dict[str, dict] = {}
    plotted_series: set[tuple] = set()
    for ef in (False, True):

        def point(run: RunRecord, ef: bool = ef):
            scheme, bits = run.summary.get("compression"), run.summary.get("bits")
            same_ef = bool(run.summary.get("error_feedback")) == ef
            if isinstance(bits, int) and (
                scheme == "none" or (scheme in ("linear", "statistical") and same_ef)
            ):
                return float(bits), run.loss
            return None

        series = _series(diloco, keys, ("compression.",), point)
        plotted_series.update(series)
        suffix = ", error feedback" if ef else ", no error feedback"
        ef_lines, ef_styles = _styled(series, groups, suffix, dashed=ef)
        lines.update(ef_lines)
        styles.update(ef_styles)
    if not lines:
        return "needs DiLoCo/MuLoCo runs at 2+ bit widths (compression.bits, or fp32 and a quantized run)"
    plotted = [r for r in diloco if _series_key(r, keys, ("compression.",)) in plotted_series]
    plots.series_plot(
        lines,
        directory / "loss_vs_bits.png",
        xlabel="bits per pseudogradient entry",
        ylabel="final validation loss",
        title="Loss vs pseudogradient quantization",
        styles=styles,
        references=_dp_references(plotted, groups),
        log2_x=True,
        tick_labels={32.0: "fp32"},
    )
    return None


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


def tuned_plot(comparisons: list[tuning.Comparison], directory: Path) -> str | None:
    """The gap to DP against K, each method at its own best, error bars over the paired seeds."""
    from muloco.tools import plots

    series = tuning.gap_series(comparisons)
    if not series:
        return "needs tuned DiLoCo/MuLoCo cells at 2+ worker counts, each with a DP baseline"
    plots.series_plot(
        series,
        directory / "tuned_gap_vs_workers.png",
        xlabel="K (workers)",
        ylabel="% over DP, each at its best (range over seeds)",
        title="Gap to data-parallel training, each method tuned",
        references={"DP": (0.0, "black")},
        log2_x=True,
    )
    return None


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
