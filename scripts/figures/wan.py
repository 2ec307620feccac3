"""The WAN figures: the headline (experiments/wan/bench_wan.py's results JSON), the link model's probes and
the testbed's delay line.

The headline is HEADLINE, a merged results JSON; its table in docs/wan.md quotes HEADLINE_ROWS, each row's
repeats from the first part that ran it at that ratio (as wan_report.headline_rows). To re-point the guide at
another results JSON: change HEADLINE (and HEADLINE_ROWS to the rows it holds), print the guide's marked
table with `python scripts/figures/wan.py`, paste it over docs/wan.md's, then
`python scripts/docs_figures.py --write` and `--check`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from figures import Figure, FigureError

HEADLINE = "experiments/wan/results/wan_headline_repeats.json"
# The guide's table: (ratio, row key), in its order (ratio highest first, then as wan_rows.ROWS).
ROWS = (
    "ddp",
    "ddp_powersgd",
    "ddp_bf16",
    "diloco_fp32",
    "muloco_fp32",
    "muloco_4bit",
    "muloco_2bit_rs",
    "streaming_4bit",
    "torchft_4bit",
    "torchft_4bit_kill",
    "hivemind_4bit",
)
COMPUTE_BOUND = ("ddp", "ddp_powersgd", "ddp_bf16", "muloco_4bit", "streaming_4bit")
ALL_HEADLINE_ROWS = (
    *((50.0, k) for k in ROWS),
    *((5.0, k) for k in ROWS),
    *((0.5, k) for k in COMPUTE_BOUND),
)
# The guide quotes the rows issue 59's rerun (below) did not run, beside the DDP and MuLoCo 4-bit rows of
# their parts, which they are compared with.
BACKEND_ROWS = (
    "ddp",
    "diloco_fp32",
    "muloco_fp32",
    "muloco_4bit",
    "muloco_2bit_rs",
    "torchft_4bit",
    "torchft_4bit_kill",
    "hivemind_4bit",
)
HEADLINE_ROWS = (*((50.0, k) for k in BACKEND_ROWS), *((5.0, k) for k in BACKEND_ROWS))
PER_STEP = ("ddp", "ddp_powersgd", "ddp_bf16")  # a 40-step window over the link, extrapolated
LABELS = {
    "ddp": "DDP fp32",
    "ddp_powersgd": "DDP + PowerSGD rank 4",
    "ddp_bf16": "DDP + bf16",
    "diloco_fp32": "DiLoCo fp32 (AdamW)",
    "muloco_fp32": "MuLoCo fp32",
    "muloco_4bit": "MuLoCo 4-bit",
    "muloco_2bit_rs": "MuLoCo 2-bit reduce-scatter",
    "streaming_4bit": "streaming MuLoCo 4-bit P=3 tau=4",
    "torchft_4bit": "MuLoCo 4-bit, torchft",
    "torchft_4bit_kill": "MuLoCo 4-bit, torchft, a worker killed and restarted",
    "hivemind_4bit": "MuLoCo 4-bit, hivemind",
}
DELAY_LINE = "experiments/benchmarks/results/bench_delay_line.json"
HIVEMIND_PROBE = "experiments/wan/results/probe_hivemind.json"
ONE_COMMAND = "experiments/wan/results/wan_headline_one_command.json"


def _r(ratio: float) -> str:
    return f"r{ratio:g}"


# -- the headline ---------------------------------------------------------------------------------------
def wan_runs(data: dict, key: str, ratio: float) -> list[dict]:
    """`key`'s repeats at `ratio`: those of the first part that ran it there (as wan_report.headline_rows)."""
    runs = [r for r in data["rows"] if r["key"] == key and r["ratio"] == ratio and not r.get("reference")]
    if not runs:
        raise FigureError(f"no row {key} at ratio {ratio:g}")
    first = min(r.get("part", 0) for r in runs)
    return [r for r in runs if r.get("part", 0) == first]


def _values(data: dict, key: str, ratio: float, field: str, scale: float) -> list[float]:
    values = [r[field] * scale for r in wan_runs(data, key, ratio) if r.get(field) is not None]
    if not values:
        raise FigureError(f"row {key} at ratio {ratio:g} has no {field}")
    return values


def wan_median(source: str, key: str, ratio: float, field: str, fmt: str, scale: float = 1.0) -> Figure:
    """The median over repeats of `key`'s `field` at `ratio` (e.g. its time to DDP's loss over DDP's)."""
    return Figure(source, lambda data: fmt.format(statistics.median(_values(data, key, ratio, field, scale))))


def wan_spread(source: str, key: str, ratio: float, field: str, fmt: str, scale: float = 1.0) -> Figure:
    """The median (min-max) over repeats of `key`'s `field` at `ratio`, as wan_report.format_repeats."""

    def render(data: dict) -> str:
        values = _values(data, key, ratio, field, scale)
        lo, mid, hi = min(values), statistics.median(values), max(values)
        return f"{fmt.format(mid)} ({fmt.format(lo)}-{fmt.format(hi)})"

    return Figure(source, render)


def wan_row_link(source: str, key: str, ratio: float) -> Figure:
    """The link `key` ran over at `ratio` (its part's: each part solved the ratio on its own machine)."""
    return Figure(source, lambda data: wan_runs(data, key, ratio)[0]["link_label"])


def wan_link(source: str, ratio: float, field: str, fmt: str) -> Figure:
    """A field of the first link of `ratio` (its rate in Mbit/s, its one-way delay in ms)."""

    def render(data: dict) -> str:
        link = next((link for link in data["links"] if link["ratio"] == ratio), None)
        if link is None:
            raise FigureError(f"no link of ratio {ratio:g}")
        return fmt.format(link[field])

    return Figure(source, render)


def wan_repeats(source: str) -> Figure:
    return Figure(source, lambda data: str(1 + max(r.get("repeat", 0) for r in data["rows"])))


def wan_steps_vs(source: str, key: str, other: str, ratio: float) -> Figure:
    """`key`'s inner steps to DDP's loss over `other`'s (medians over repeats): how many more tokens."""

    def render(data: dict) -> str:
        mine = statistics.median(_values(data, key, ratio, "steps_to_target", 1.0))
        theirs = statistics.median(_values(data, other, ratio, "steps_to_target", 1.0))
        return f"{mine / theirs:.2f}x"

    return Figure(source, render)


def wan_planner_within(source: str, rows: tuple, tolerance: float = 0.1) -> Figure:
    """How many of `rows`' medians of measured / planner lie within `tolerance` of 1: "26 of 27"."""

    def render(data: dict) -> str:
        field = "measured_over_planner"
        medians = [statistics.median(_values(data, k, ratio, field, 1.0)) for ratio, k in rows]
        return f"{sum(abs(m - 1) <= tolerance for m in medians)} of {len(medians)}"

    return Figure(source, render)


def headline_figures(source: str, rows: tuple) -> dict[str, Figure]:
    """The guide table's cells for each (ratio, key): link, time to DDP's loss, vs DDP, network wait,
    measured / planner, inner steps and MB per worker (counted) to DDP's loss."""
    figures: dict[str, Figure] = {}
    for ratio, key in rows:
        name = f"wan.{_r(ratio)}.{key}"
        figures[f"{name}.link"] = wan_row_link(source, key, ratio)
        figures[f"{name}.to_loss_s"] = wan_spread(source, key, ratio, "s_to_target", "{:.0f}")
        figures[f"{name}.vs_ddp_spread"] = wan_spread(source, key, ratio, "vs_ddp", "{:.3f}x")
        figures[f"{name}.wait"] = wan_median(source, key, ratio, "wait_fraction", "{:.1f}%", 100)
        figures[f"{name}.vs_planner"] = wan_median(source, key, ratio, "measured_over_planner", "{:.2f}")
        figures[f"{name}.steps"] = wan_median(source, key, ratio, "steps_to_target", "{:,.0f}")
        figures[f"{name}.mb"] = wan_median(source, key, ratio, "bytes_to_target", "{:.1f}", 1e-6)
    return figures


def headline_table(rows: tuple = HEADLINE_ROWS) -> str:
    """docs/wan.md's headline table, marked, its values left for `docs_figures.py --write` to fill in."""

    def fig(name: str) -> str:
        return f"<!-- fig {name} -->?<!-- /fig -->"

    lines = [
        "| link (ratio) | method | to DDP's loss, s | vs DDP | network wait | measured / planner "
        "| inner steps | MB / worker |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ratio, key in rows:
        n = f"wan.{_r(ratio)}.{key}"
        window = " (window)" if key in PER_STEP else ""
        cells = [
            f"{fig(n + '.link')} ({ratio:g})",
            LABELS.get(key, key),
            fig(n + ".to_loss_s") + window,
            *(fig(f"{n}.{c}") for c in ("vs_ddp_spread", "wait", "vs_planner", "steps", "mb")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the delay line, the hivemind probe, the one command ------------------------
def delay_line(field: str, fmt: str, unit: str = "") -> Figure:
    """Over the delay-line cases (25 ms one way, every rate): the range of the cases' medians of `field`
    (round_trip_ms), or of their share of the line's TCP rate (of_tcp_line_rate)."""

    def render(data: dict) -> str:
        rows = [r for r in data["rows"] if r["forwarding"] == "delay line"]
        if not rows:
            raise FigureError("no delay-line case")
        values = [r[field]["median"] if isinstance(r[field], dict) else r[field] for r in rows]
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}{unit}"

    return Figure(DELAY_LINE, render)


FIGURES: dict[str, Figure] = {
    "wan.repeats": wan_repeats(HEADLINE),
    # the guide's
    "wan.r50.torchft_4bit_kill.vs_undisturbed": wan_spread(
        HEADLINE, "torchft_4bit_kill", 50, "vs_undisturbed", "{:.2f}x"
    ),
    "wan.r5.torchft_4bit_kill.vs_undisturbed": wan_spread(
        HEADLINE, "torchft_4bit_kill", 5, "vs_undisturbed", "{:.2f}x"
    ),
    "wan.planner_within": wan_planner_within(HEADLINE, ALL_HEADLINE_ROWS),
    "wan.r50.muloco_4bit.tokens_vs_ddp": wan_steps_vs(HEADLINE, "muloco_4bit", "ddp", 50),
    "wan.r50.diloco_fp32.tokens_vs_ddp": wan_steps_vs(HEADLINE, "diloco_fp32", "ddp", 50),
    **headline_figures(HEADLINE, HEADLINE_ROWS),
    # the delay line (bench_delay_line.py, 2026-12-02)
    "wan.delay_line.rtt": delay_line("round_trip_ms", "{:.1f}", " ms"),
    "wan.delay_line.share": delay_line("of_tcp_line_rate", "{:.2f}"),
    # hivemind's sync, fitted (probe_hivemind.py, 2026-12-03)
    "wan.hivemind.local": Figure(HIVEMIND_PROBE, lambda d: f"{1000 * d['local_s']:.0f} ms"),
    "wan.hivemind.round_trips": Figure(HIVEMIND_PROBE, lambda d: f"{d['round_trips']:.1f}"),
    # the one command, one run (2026-12-04)
    "wan.one_command.min": Figure(ONE_COMMAND, lambda d: f"{d['bench_s'] / 60:.1f} min"),
    "wan.one_command.step_ms": Figure(ONE_COMMAND, lambda d: f"{1000 * d['compute_s_per_ddp_step']:.1f} ms"),
}


# -- the headline again (issue 59): overlap, and the strongest baseline, per ratio -------------------------
# Every ratio runs the whole-window rows at their tuned outer lr and momentum (wan_rows.py), over the same
# loss curves (--reuse-curves).
OVERLAP_SOURCES = {
    50: "experiments/wan/results/wan_headline_59_r50.json",
    5: "experiments/wan/results/wan_headline_59_r5.json",
    0.5: "experiments/wan/results/wan_headline_59_r0.5.json",
}
OVERLAP = OVERLAP_SOURCES[50]
OVERLAP_ROWS = (
    "ddp",
    "ddp_powersgd",
    "ddp_bf16",
    "muloco_4bit",
    "muloco_4bit_window",
    "muloco_4bit_eager",
    "streaming_4bit",
)
OVERLAP_CELLS = (  # (name, field, format, scale)
    ("to_loss_s", "s_to_target", "{:.0f}", 1.0),
    ("vs_ddp", "vs_ddp", "{:.3f}x", 1.0),
    ("vs_best", "vs_best_ddp", "{:.3f}x", 1.0),
    ("wait", "wait_fraction", "{:.1f}%", 100.0),
    ("over_compute", "wall_over_compute", "{:.2f}x", 1.0),
    ("steps", "steps_to_target", "{:,.0f}", 1.0),
)


def spread_or_missed(source: str, key: str, ratio: float, field: str, fmt: str, scale: float) -> Figure:
    """wan_spread's median (min-max), or "not reached" where no repeat reached DDP's loss."""

    def render(data: dict) -> str:
        runs = wan_runs(data, key, ratio)
        if not any(r.get("s_to_target") for r in runs):
            return "not reached"
        return wan_spread(source, key, ratio, field, fmt, scale).render(data)

    return Figure(source, render)


def ddp_check(source: str, ratio: float, field: str, fmt: str) -> Figure:
    """bench_wan --check-ddp's longer DDP run at `ratio` against the 40-step windows' extrapolation."""

    def render(data: dict) -> str:
        check = next((c for c in data.get("ddp_checks", []) if c["ratio"] == ratio), None)
        if check is None:
            raise FigureError(f"no DDP check at ratio {ratio:g} (bench_wan.py --check-ddp)")
        return fmt.format(check[field])

    return Figure(source, render)


def link_figures(prefix: str, sources: dict[float, str], rows: tuple) -> dict[str, Figure]:
    """Per ratio and row of `sources` (one bench_wan JSON a ratio): the cells of link_table."""
    first = sources[next(iter(sources))]
    figures = {
        f"{prefix}.repeats": wan_repeats(first),
        f"{prefix}.compute_ms": Figure(first, lambda d: f"{1000 * d['compute_s_per_ddp_step']:.1f} ms"),
    }
    for ratio, source in sources.items():
        r = f"{prefix}.r{ratio:g}"
        figures |= {
            f"{r}.link": wan_link(source, ratio, "label", "{}"),
            f"{r}.ddp.ratio_measured": wan_median(source, "ddp", ratio, "ratio_measured", "{:.1f}"),
        }
        for key in rows:
            for cell, field, fmt, scale in OVERLAP_CELLS:
                # the wait is measured whether or not a row reaches DDP's loss
                spread = wan_spread if cell == "wait" else spread_or_missed
                figures[f"{r}.{key}.{cell}"] = spread(source, key, ratio, field, fmt, scale)
            # one loss curve serves every repeat (bench_wan reuses it), so one value
            figures[f"{r}.{key}.val_equal_tokens"] = wan_median(
                source, key, ratio, "val_equal_tokens", "{:.3f}"
            )
    return figures


def overlap_figures() -> dict[str, Figure]:
    figures = link_figures("wan59", OVERLAP_SOURCES, OVERLAP_ROWS)
    for ratio, source in OVERLAP_SOURCES.items():
        r = f"wan59.r{ratio:g}"
        figures |= {
            f"{r}.check.kind": ddp_check(source, ratio, "kind", "{}"),
            f"{r}.check.measured_s": ddp_check(source, ratio, "measured_s", "{:,.0f} s"),
            f"{r}.check.ratio": ddp_check(source, ratio, "extrapolated_over_measured", "{:.3f}"),
        }
    return figures


FIGURES.update(overlap_figures())


def link_table(prefix: str, sources: dict[float, str], rows: tuple, labels: dict[str, str]) -> str:
    """A docs table of link_figures' cells, every ratio, marked (docs_figures.py --write fills it)."""
    lines = [
        "| ratio | method | to DDP's loss, s | vs DDP | vs best DDP | network wait | wall / own compute "
        "| inner steps | val loss, DDP's tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio in sources:
        for key in rows:
            names = [cell for cell, *_ in OVERLAP_CELLS] + ["val_equal_tokens"]
            cells = [f"<!-- fig {prefix}.r{ratio:g}.{key}.{cell} -->?<!-- /fig -->" for cell in names]
            window = " (window)" if key in PER_STEP else ""
            lines.append(
                f"| {ratio:g} | {labels[key]} | {cells[0]}{window} | " + " | ".join(cells[1:]) + " |"
            )
    return "\n".join(lines)


def overlap_table() -> str:
    """docs/wan.md's table of the issue-59 rerun, every ratio, marked (docs_figures.py --write fills it)."""
    labels = {
        **LABELS,
        "muloco_4bit_window": "MuLoCo 4-bit, whole window overlapped",
        "muloco_4bit_eager": "MuLoCo 4-bit, whole window, eager",
    }
    return link_table("wan59", OVERLAP_SOURCES, OVERLAP_ROWS, labels)


if __name__ == "__main__":
    print(headline_table())
    print()
    print(overlap_table())


# -- the rows' lrs, tuned under the headline's schedule (configs/sweeps/wan_tune*.yaml, one seed) ------------
TUNE = "experiments/wan/results/wan_tune/tuned.json"
TUNE_HOOKS = "experiments/wan/results/wan_tune_hooks/tuned.json"
TUNE_OVERLAP = "experiments/wan/results/wan_tune_overlap/tuned.json"
TUNE_NAIVE = "experiments/wan/results/wan_tune_overlap_naive/tuned.json"  # the naive row's grid, extended


def tuned_lr(source: str, settings: dict, side: str, key: str) -> Figure:
    """The best `key` of a tuned.json row (`muloco report --tune-over`) whose settings include `settings`;
    side "cell": the DiLoCo/MuLoCo runs', "dp": the DP baseline's."""

    def render(data: dict) -> str:
        for row in data["rows"]:
            cell = row[side]
            if cell is not None and settings.items() <= cell["settings"].items():
                return f"{cell['best'][key]:g}"
        raise FigureError(f"no tuned row with {settings} ({side})")

    return Figure(source, render)


def tuned_outer(eager: bool) -> Figure:
    """'lr, momentum' of a whole-window row: the lowest final loss among wan_tune_overlap's cell of that
    variant and (naive) wan_tune_overlap_naive's, the grid extended below its lowest momentum."""

    def render(data: dict) -> str:
        rows = [r for r in data["rows"] if r["cell"]["settings"].get("sync.eager") is eager]
        if not eager:
            rows += json.loads((Path(__file__).resolve().parents[2] / TUNE_NAIVE).read_text())["rows"]
        if not rows:
            raise FigureError(f"no tuned row with sync.eager {eager}")
        best = min(rows, key=lambda r: r["final_val_loss"])["cell"]["best"]
        return f"{best['outer.lr']:g}, {best['outer.momentum']:g}"

    return Figure(TUNE_OVERLAP, render)


FIGURES.update(
    {
        "wan.tune.window_outer": tuned_outer(False),
        "wan.tune.eager_outer": tuned_outer(True),
        "wan.tune.dp_lr": tuned_lr(TUNE, {"inner.optimizer": "muon"}, "dp", "inner.lr"),
        "wan.tune.muloco_lr": tuned_lr(TUNE, {"inner.optimizer": "muon"}, "cell", "inner.lr"),
        "wan.tune.diloco_lr": tuned_lr(TUNE, {"inner.optimizer": "adamw"}, "cell", "inner.adamw.lr"),
        # a sweep of DP runs only: its runs are the report's cells
        "wan.tune.bf16_lr": tuned_lr(TUNE_HOOKS, {"dp.comm_hook": "bf16"}, "cell", "inner.lr"),
        "wan.tune.powersgd_lr": tuned_lr(TUNE_HOOKS, {"dp.comm_hook": "powersgd"}, "cell", "inner.lr"),
    }
)
