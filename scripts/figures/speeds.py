"""Workers of different speeds (issue 62), quoted by docs/heterogeneous.md: the asynchronous rule's outer
momentum (experiments/wan/results/async_tune.json, simulated runs) and the straggler deadline's bound
(experiments/benchmarks/results/bench_deadline.json, a hivemind swarm with a host stopped); and
bench_speeds.py's table of the rows on hosts of unequal speeds, quoted by docs/wan.md, from three runs of it
(each row's ratio against the equal-speed reference run beside it, in the same repeat):
experiments/wan/results/bench_speeds.json (speeds equal, half, quarter), bench_speeds_by_speed_lag.json
(the paced-by-speed rows again, after their step-time exchange left the round: these replace the first
run's) and bench_speeds_spread.json (speeds 1, 0.75, 0.5, 0.25).
"""

from __future__ import annotations

import statistics

from figures import Figure, FigureError

TUNE = "experiments/wan/results/async_tune.json"
DEADLINE = "experiments/benchmarks/results/bench_deadline.json"
SPEEDS = "experiments/wan/results/bench_speeds.json"
BY_SPEED = "experiments/wan/results/bench_speeds_by_speed_lag.json"
SPREAD = "experiments/wan/results/bench_speeds_spread.json"
RUNS = (SPEEDS, BY_SPEED, SPREAD)  # the combined table's sources, in this order
ROW_LABELS = {
    "sync": "synchronous",
    "by_speed": "paced by speed",
    "async": "asynchronous",
    "drop_slow": "slowest host dropped",
}
OURS = ("by_speed", "async")  # the rows that keep the slow host's work
# Issue 62's goals: the best row's time to the equal-speed run's loss, x that run's (ideal: 4 / the compute
# the hosts hold, 1.14x and 1.23x)
GOALS = {"half": 1.2, "quarter": 1.35, "spread": None}  # spread: no goal but dropping the slow host


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


def _entries(runs: list[dict]) -> list[tuple[list[float], dict, dict]]:
    """The combined table's (speeds, entry, its run) in scenario order: the first run's rows but paced by
    speed (the exchange that the later by_speed run measures replaced the one they had), the by_speed run's
    rows, the spread run's rows but its reference (the first run's stands for the equal-speed rows)."""
    first, by_speed, spread = runs
    chosen = [(e, first) for e in first["table"] if e["row"] != "by_speed"]
    chosen += [(e, by_speed) for e in by_speed["table"] if e["row"] == "by_speed"]
    chosen += [(e, spread) for e in spread["table"] if e["scenario"] != "equal"]
    scenarios = {**first["scenarios"], **spread["scenarios"]}
    order, rows = list(scenarios), list(ROW_LABELS)
    chosen.sort(key=lambda c: (order.index(c[0]["scenario"]), rows.index(c[0]["row"])))
    return [(scenarios[e["scenario"]], e, run) for e, run in chosen]


def _speeds_table(runs: list[dict]) -> str:
    """Every scenario's rows: time to the equal-speed synchronous run's final loss (x its time), the loss at
    its time, the horizon each row needed."""
    lines = [
        "",
        "| hosts' speeds | row | time to the reference loss (x) | loss at the reference time | rounds (x) |",
        "|---|---|---|---|---|",
    ]
    for speeds, entry, _ in _entries(runs):
        loss = entry["loss_at_equal_time_median"]
        lines.append(
            f"| {', '.join(f'{v:g}' for v in speeds)} | {ROW_LABELS[entry['row']]} | {_ratio(entry)} | "
            f"{f'{loss:.4f}' if loss is not None else 'none yet'} | {entry['horizon']:g} |"
        )
    return "\n".join(lines) + "\n"


def _entry(runs: list[dict], scenario: str, row: str) -> tuple[dict, dict]:
    """The combined table's entry of `row` in `scenario`, and the run it is from."""
    for _, entry, run in _entries(runs):
        if (entry["scenario"], entry["row"]) == (scenario, row):
            return entry, run
    raise FigureError(f"no row {row} of {scenario} in {', '.join(RUNS)}")


def _best(runs: list[dict], scenario: str) -> dict:
    """The fastest of the rows that keep every host (paced by speed, asynchronous) to the reference loss."""
    reached = [
        e
        for _, e, _ in _entries(runs)
        if e["scenario"] == scenario and e["row"] in OURS and e["vs_equal_sync_median"] is not None
    ]
    if not reached:
        raise FigureError(f"no row of {scenario} reached the target in {', '.join(RUNS)}")
    return min(reached, key=lambda e: e["vs_equal_sync_median"])


def _goal(scenario: str) -> Figure:
    """The best row of `scenario` that keeps every host, against its goal (if it has one) and against
    dropping the slow host: 'paced by speed, 1.18x (1.15-1.22): met, and faster than dropping the slow
    host'."""

    def render(runs: list[dict]) -> str:
        best = _best(runs, scenario)
        drop, _ = _entry(runs, scenario, "drop_slow")
        than = "faster" if best["vs_equal_sync_median"] < drop["vs_equal_sync_median"] else "slower"
        goal = GOALS[scenario]
        met = ""
        if goal is not None:
            met = "met, and " if best["vs_equal_sync_median"] <= goal else "missed, and "
        return f"{ROW_LABELS[best['row']]}, {_ratio(best)}: {met}{than} than dropping the slow host"

    return Figure(RUNS, render)


def _scenario_row(scenario: str, row: str) -> Figure:
    return Figure(RUNS, lambda runs: _ratio(_entry(runs, scenario, row)[0]))


def _per_round(scenario: str, row: str, part: str) -> Figure:
    """A row's median ms a round of `part` (compute_ms, wait_ms, other_ms) over its round: '175 of 855 ms'."""

    def render(runs: list[dict]) -> str:
        _, run = _entry(runs, scenario, row)
        return _part_of_round(run, scenario, row, part, ", ".join(RUNS))

    return Figure(RUNS, render)


def _part_of_round(run: dict, scenario: str, row: str, part: str, where: str) -> str:
    """The median ms a round of `part` of `row` in `scenario` over the run's repeats: '175 of 855 ms'."""
    mine = [r for r in run["runs"] if (r["scenario"], r["row"]) == (scenario, row)]
    if not mine or part not in mine[0]:
        raise FigureError(f"no {part} for {row} of {scenario} in {where}")
    median = statistics.median(r[part] for r in mine)
    return f"{median:.0f} of {statistics.median(r['round_ms'] for r in mine):.0f} ms"


def _horizon(scenario: str, row: str) -> Figure:
    """The rounds a row needed to reach the reference loss, x the reference's: '1.3x'."""
    return Figure(RUNS, lambda runs: f"{_entry(runs, scenario, row)[0]['horizon']:g}x")


def _equal_seconds(data: dict) -> str:
    """The equal-speed synchronous run's train time to its final loss, median over the repeats."""
    times = [r["time_to_target_s"] for r in data["runs"] if (r["scenario"], r["row"]) == ("equal", "sync")]
    return f"{statistics.median(times):.0f} s"


def _repeats(runs: list[dict]) -> str:
    """The fewest repeats of any row of the combined table."""
    return str(min(entry["repeats"] for _, entry, _ in _entries(runs)))


def _reference_part(source: str, part: str) -> Figure:
    """The equal-speed reference's median ms a round of `part` in the run at `source` (beside that run's
    rows, as their ratios are): '142 of 899 ms'."""

    return Figure(source, lambda data: _part_of_round(data, "equal", "sync", part, source))


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
    "speeds.bench.table": Figure(RUNS, _speeds_table),
    "speeds.bench.goal_half": _goal("half"),
    "speeds.bench.goal_quarter": _goal("quarter"),
    "speeds.bench.goal_spread": _goal("spread"),
    "speeds.bench.sync_half": _scenario_row("half", "sync"),
    "speeds.bench.sync_quarter": _scenario_row("quarter", "sync"),
    "speeds.bench.sync_spread": _scenario_row("spread", "sync"),
    "speeds.bench.drop_half": _scenario_row("half", "drop_slow"),
    "speeds.bench.drop_quarter": _scenario_row("quarter", "drop_slow"),
    "speeds.bench.drop_spread": _scenario_row("spread", "drop_slow"),
    "speeds.bench.equal_s": Figure(SPEEDS, _equal_seconds),
    "speeds.bench.repeats": Figure(RUNS, _repeats),
    "speeds.bench.other_half_by_speed": _per_round("half", "by_speed", "other_ms"),
    "speeds.bench.wait_equal_by_speed": _per_round("equal", "by_speed", "wait_ms"),
    "speeds.bench.wait_half_by_speed": _per_round("half", "by_speed", "wait_ms"),
    "speeds.bench.wait_quarter_by_speed": _per_round("quarter", "by_speed", "wait_ms"),
    "speeds.bench.wait_reference_by_speed_run": _reference_part(BY_SPEED, "wait_ms"),
    "speeds.bench.rounds_half_by_speed": _horizon("half", "by_speed"),
    "speeds.bench.rounds_equal_async": _horizon("equal", "async"),
    "speeds.bench.rounds_half_drop": _horizon("half", "drop_slow"),
    "speeds.bench.rounds_spread_by_speed": _horizon("spread", "by_speed"),
}
