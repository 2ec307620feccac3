"""The report's figures, drawn with matplotlib's Agg canvas (no display, no pyplot global state).

Each function takes plain data (lists of numbers and labels) and writes one PNG; the choice of runs and
series is the report's (muloco/tools/report.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

# A curve: (label, is_dp_baseline, tokens, val losses).
Curve = tuple[str, bool, list[float], list[float]]


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# DP baselines: dark and broken like a reference line, each with its own dash pattern and marker, so that a
# panel's legend tells several baselines (e.g. one per K) apart.
BASELINE_STYLES = [
    {"color": "black", "linestyle": "--", "marker": "x"},
    {"color": "dimgray", "linestyle": "-.", "marker": "+"},
    {"color": "black", "linestyle": ":", "marker": "s"},
    {"color": "dimgray", "linestyle": (0, (5, 1, 1, 1, 1, 1)), "marker": "^"},
    {"color": "gray", "linestyle": (0, (1, 1)), "marker": "v"},
    {"color": "black", "linestyle": (0, (8, 2)), "marker": "D"},
]


def curve_styles(curves: list[Curve]) -> list[dict]:
    """The plot style of each curve of a panel: DP baselines each their own (BASELINE_STYLES, in turn),
    the other runs matplotlib's colour cycle with dots."""
    styles, baselines = [], 0
    for _, is_dp, _, _ in curves:
        if is_dp:
            styles.append({**BASELINE_STYLES[baselines % len(BASELINE_STYLES)], "markersize": 4})
            baselines += 1
        else:
            styles.append({"marker": ".", "markersize": 3})
    return styles


def loss_vs_tokens(groups: dict[str, list[Curve]], path: Path) -> None:
    """Validation loss against tokens seen, one panel per inner optimizer; DP baselines dark and broken,
    each its own style."""
    fig = Figure(figsize=(5.5 * len(groups), 4.2))
    axes = fig.subplots(1, len(groups), squeeze=False, sharey=True)[0]
    for ax, (group, curves) in zip(axes, groups.items(), strict=True):
        for (label, _, tokens, losses), style in zip(curves, curve_styles(curves), strict=True):
            ax.plot(tokens, losses, linewidth=1.2, label=label, **style)
        ax.set_title(f"inner optimizer: {group}")
        ax.set_xlabel("tokens seen (all workers)")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_number(x)))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss")
    _bottom_at_final_losses(axes, groups)
    _save(fig, path)


def _bottom_at_final_losses(axes, groups: dict[str, list[Curve]]) -> None:
    """Show every eval point: the y axis spans the lowest loss to the highest first eval (~ln V); a log
    scale keeps the end of training, where runs differ, readable beside the first evals."""
    losses = [v for curves in groups.values() for c in curves for v in c[3] if math.isfinite(v)]
    if losses:
        low, high = min(losses), max(losses)
        axes[0].set_yscale("log")
        axes[0].set_ylim(low * 0.98, high * 1.02)
        ticks = sorted({float(f"{y:.2g}") for y in _geomspace(low, high, 9)})
        axes[0].yaxis.set_major_locator(FixedLocator(ticks))
        axes[0].yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        axes[0].yaxis.set_minor_locator(NullLocator())


def _geomspace(low: float, high: float, n: int) -> list[float]:
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]


def short_number(x: float) -> str:
    """300000 -> 300k, 1500000 -> 1.5M: tick labels for token counts."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= size:
            return f"{x / size:g}{suffix}"
    return f"{x:g}"


def series_plot(
    series: dict[str, list[tuple[float, ...]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    styles: dict[str, dict] | None = None,
    references: dict[str, tuple[float, str]] | None = None,
    log2_x: bool = False,
    tick_labels: dict[float, str] | None = None,
) -> None:
    """Lines of (x, y) points, one per series, or (x, y, low, high) points drawn with error bars from low to
    high; references are labelled horizontal lines (y, color)."""
    fig = Figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    for label, points in series.items():
        points = sorted(points)
        style = {"marker": "o", **(styles or {}).get(label, {})}
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if all(len(p) == 4 for p in points):
            below, above = [p[1] - p[2] for p in points], [p[3] - p[1] for p in points]
            ax.errorbar(xs, ys, yerr=[below, above], label=label, capsize=3, **style)
        else:
            ax.plot(xs, ys, label=label, **style)
    for label, (y, color) in (references or {}).items():
        ax.axhline(y, color=color, linestyle=":", linewidth=1.2, label=label)
    xs = sorted({p[0] for points in series.values() for p in points})
    if log2_x and xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(xs))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([(tick_labels or {}).get(x, _number(x)) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def _number(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else f"{x:g}"
