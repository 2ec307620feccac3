"""The report's plots (PNGs, drawn with plots.py): val loss vs tokens, % over DP vs K, loss vs bits with and
without error feedback, loss vs H, and the tuned gap to DP vs K. A plot the runs have no data for is
skipped, with the reason report.md gives."""

from __future__ import annotations

from pathlib import Path

from muloco.tools import tuning
from muloco.tools.runs import LR_KEYS, RunRecord, own_lr, value_text

PLOTS = {
    "loss_vs_tokens.png": "validation loss vs tokens, per inner optimizer",
    "pct_over_dp_vs_workers.png": "% over the DP baseline vs K (workers), per inner optimizer",
    "loss_vs_bits.png": "final validation loss vs bits per pseudogradient entry, with and without EF",
    "loss_vs_sync_every.png": "final validation loss vs H (sync.every)",
    "tuned_gap_vs_workers.png": "% over DP vs K, each method and its DP at their own best setting",
}

Series = dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]]
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _series_key(run: RunRecord, keys: list[str], drop: tuple[str, ...]) -> tuple:
    """(inner optimizer, its own lr, then the values of the other varied keys not on the plot's axes).
    Under Muon a varied AdamW-side lr is kept as `adamw.lr`; under AdamW, Muon's lr means nothing."""
    skip = ("inner.optimizer", "method", *LR_KEYS)
    other = [(k, value_text(run.config.get(k))) for k in keys if k not in skip and not k.startswith(drop)]
    if run.group != "adamw" and "inner.adamw.lr" in keys:
        other.insert(0, ("adamw.lr", value_text(run.config.get("inner.adamw.lr"))))
    return run.group, (("lr", value_text(own_lr(run))), *other)


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
