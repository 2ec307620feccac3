"""Workers of different speeds (issue 62), quoted by docs/heterogeneous.md: the asynchronous rule's outer
momentum (experiments/wan/results/async_tune.json, simulated runs) and the straggler deadline's bound
(experiments/benchmarks/results/bench_deadline.json, a hivemind swarm with a host stopped); and
bench_speeds.py's table of the rows on hosts of unequal speeds (experiments/wan/results/bench_speeds.json),
quoted by docs/heterogeneous.md and docs/wan.md.
"""

from __future__ import annotations

import statistics

from figures import Figure, FigureError

TUNE = "experiments/wan/results/async_tune.json"
DEADLINE = "experiments/benchmarks/results/bench_deadline.json"
SPEEDS = "experiments/wan/results/bench_speeds.json"
ROW_LABELS = {
    "sync": "synchronous",
    "by_speed": "paced by speed",
    "async": "asynchronous",
    "drop_slow": "slowest host dropped",
}
OURS = ("by_speed", "async")  # the rows that keep the slow host's work
# Issue 62's goals: the best row's time to the equal-speed run's loss, x that run's (ideal: 4 / the compute
# the hosts hold, 1.14x and 1.23x)
GOALS = {"half": 1.2, "quarter": 1.35}


def _loss(data: dict, name: str) -> float:
    for run in data["runs"]:
        if run["name"] == name:
            return run["final_val_loss"]
    raise FigureError(f"no run {name} in {TUNE}")


def _vs(name: str, reference: str) -> Figure:
    """Run `name`'s final loss over `reference`'s, as a signed percentage."""
    return Figure(TUNE, lambda data: f"{100 * (_loss(data, name) / _loss(data, reference) - 1):+.1f}%")


def _seeds(a: str, b: str) -> Figure:
    """a's over b's on seed 0 and seed 1: '-3.7% / -3.8%'."""

    def render(data: dict) -> str:
        diffs = [100 * (_loss(data, a + s) / _loss(data, b + s) - 1) for s in ("", "_s1")]
        return " / ".join(f"{d:+.1f}%" for d in diffs)

    return Figure(TUNE, render)


def _row(data: dict, row: str) -> dict:
    for entry in data["table"]:
        if entry["row"] == row:
            return entry
    raise FigureError(f"no row {row} in {DEADLINE}")


def _bound(row: str) -> Figure:
    def render(data: dict) -> str:
        entry = _row(data, row)
        if entry["bound_median"] is None:
            return "no run completed"
        lo, hi = entry["bound_range"]
        return f"{entry['bound_median']:.2f}x ({lo:.2f}-{hi:.2f})"

    return Figure(DEADLINE, render)


def _failed(row: str) -> Figure:
    """'1 of 3' runs of `row` that never got as far as the stop, or whose swarm fell apart."""

    def render(data: dict) -> str:
        mine = [r for r in data["runs"] if r["row"] == row]
        return f"{sum('failed' in r for r in mine)} of {len(mine)}"

    return Figure(DEADLINE, render)


def _round(row: str) -> Figure:
    def render(data: dict) -> str:
        entry = _row(data, row)
        return f"{entry['median_round_s']:.1f} s" if entry["bound_median"] is not None else "unmeasured"

    return Figure(DEADLINE, render)


def _ratio(entry: dict) -> str:
    if entry["vs_equal_sync_median"] is None:
        return f"not reached ({entry['reached']} of {entry['repeats']})"
    lo, hi = entry["vs_equal_sync_range"]
    return f"{entry['vs_equal_sync_median']:.2f}x ({lo:.2f}-{hi:.2f})"


def _speeds_table(data: dict) -> str:
    """Every scenario's rows: time to the equal-speed synchronous run's final loss (x its time), the loss at
    its time, the horizon each row needed."""
    lines = [
        "",
        "| hosts' speeds | row | time to the reference loss (x) | loss at the reference time | rounds (x) |",
        "|---|---|---|---|---|",
    ]
    order = list(ROW_LABELS)
    for scenario, speeds in data["scenarios"].items():
        mine = sorted(
            (e for e in data["table"] if e["scenario"] == scenario), key=lambda e: order.index(e["row"])
        )
        for entry in mine:
            loss = entry["loss_at_equal_time_median"]
            lines.append(
                f"| {', '.join(f'{v:g}' for v in speeds)} | {ROW_LABELS[entry['row']]} | {_ratio(entry)} | "
                f"{f'{loss:.4f}' if loss is not None else 'none yet'} | {entry['horizon']:g} |"
            )
    return "\n".join(lines) + "\n"


def _best(data: dict, scenario: str) -> dict:
    """The fastest of the rows that keep every host (paced by speed, asynchronous) to the reference loss."""
    reached = [
        e
        for e in data["table"]
        if e["scenario"] == scenario and e["row"] in OURS and e["vs_equal_sync_median"] is not None
    ]
    if not reached:
        raise FigureError(f"no row of {scenario} reached the target in {SPEEDS}")
    return min(reached, key=lambda e: e["vs_equal_sync_median"])


def _goal(scenario: str) -> Figure:
    """The best row of `scenario` that keeps every host, against its goal and against dropping the slow
    host: 'paced by speed, 1.18x (1.15-1.22): met, and faster than dropping the slow host'."""

    def render(data: dict) -> str:
        best = _best(data, scenario)
        met = "met" if best["vs_equal_sync_median"] <= GOALS[scenario] else "missed"
        drop = _entry(data, scenario, "drop_slow")
        than = "faster" if best["vs_equal_sync_median"] < drop["vs_equal_sync_median"] else "slower"
        return f"{ROW_LABELS[best['row']]}, {_ratio(best)}: {met}, and {than} than dropping the slow host"

    return Figure(SPEEDS, render)


def _entry(data: dict, scenario: str, row: str) -> dict:
    """bench_speeds' table entry of `row` in `scenario`."""
    for entry in data["table"]:
        if (entry["scenario"], entry["row"]) == (scenario, row):
            return entry
    raise FigureError(f"no row {row} of {scenario} in {SPEEDS}")


def _scenario_row(scenario: str, row: str) -> Figure:
    return Figure(SPEEDS, lambda data: _ratio(_entry(data, scenario, row)))


def _per_round(scenario: str, row: str, part: str) -> Figure:
    """A row's median ms a round of `part` (compute_ms, wait_ms, other_ms) over its round: '175 of 855 ms'."""

    def render(data: dict) -> str:
        mine = [r for r in data["runs"] if (r["scenario"], r["row"]) == (scenario, row)]
        if not mine or part not in mine[0]:
            raise FigureError(f"no {part} for {row} of {scenario} in {SPEEDS}")
        median = statistics.median(r[part] for r in mine)
        return f"{median:.0f} of {statistics.median(r['round_ms'] for r in mine):.0f} ms"

    return Figure(SPEEDS, render)


def _horizon(scenario: str, row: str) -> Figure:
    """The rounds a row needed to reach the reference loss, x the reference's: '1.3x'."""
    return Figure(SPEEDS, lambda data: f"{_entry(data, scenario, row)['horizon']:g}x")


def _equal_seconds(data: dict) -> str:
    """The equal-speed synchronous run's train time to its final loss, median over the repeats."""
    times = [r["time_to_target_s"] for r in data["runs"] if (r["scenario"], r["row"]) == ("equal", "sync")]
    return f"{statistics.median(times):.0f} s"


def _repeats(data: dict) -> str:
    return str(data["repeats_done"])


FIGURES: dict[str, Figure] = {
    "speeds.async.m03_vs_sync": _vs("async_lr0.7_m0.3", "sync_equal"),
    "speeds.async.m06_vs_sync": _vs("async_lr0.7_m0.6", "sync_equal"),
    "speeds.async.m03_vs_m06": _seeds("async_lr0.7_m0.3", "async_lr0.7_m0.6"),
    "speeds.async.equal_m03_vs_sync": _vs("async_eq_lr0.7_m0.3", "sync_equal"),
    "speeds.deadline.bound_adaptive": _bound("adaptive"),
    "speeds.deadline.bound_off": _bound("off"),
    "speeds.deadline.round_adaptive": _round("adaptive"),
    "speeds.deadline.round_off": _round("off"),
    "speeds.deadline.failed_adaptive": _failed("adaptive"),
    "speeds.deadline.failed_off": _failed("off"),
    "speeds.bench.table": Figure(SPEEDS, _speeds_table),
    "speeds.bench.goal_half": _goal("half"),
    "speeds.bench.goal_quarter": _goal("quarter"),
    "speeds.bench.sync_half": _scenario_row("half", "sync"),
    "speeds.bench.sync_quarter": _scenario_row("quarter", "sync"),
    "speeds.bench.drop_half": _scenario_row("half", "drop_slow"),
    "speeds.bench.drop_quarter": _scenario_row("quarter", "drop_slow"),
    "speeds.bench.equal_s": Figure(SPEEDS, _equal_seconds),
    "speeds.bench.repeats": Figure(SPEEDS, _repeats),
    "speeds.bench.other_equal_by_speed": _per_round("equal", "by_speed", "other_ms"),
    "speeds.bench.other_half_by_speed": _per_round("half", "by_speed", "other_ms"),
    "speeds.bench.other_quarter_by_speed": _per_round("quarter", "by_speed", "other_ms"),
    "speeds.bench.other_equal_sync": _per_round("equal", "sync", "other_ms"),
    "speeds.bench.rounds_half_by_speed": _horizon("half", "by_speed"),
    "speeds.bench.rounds_equal_async": _horizon("equal", "async"),
    "speeds.bench.rounds_half_drop": _horizon("half", "drop_slow"),
}
