"""Workers of different speeds (issue 62), quoted by docs/heterogeneous.md: the asynchronous rule's outer
momentum (experiments/wan/results/async_tune.json, simulated runs) and the straggler deadline's bound
(experiments/benchmarks/results/bench_deadline.json, a hivemind swarm with a host stopped).
"""

from __future__ import annotations

from figures import Figure, FigureError

TUNE = "experiments/wan/results/async_tune.json"
DEADLINE = "experiments/benchmarks/results/bench_deadline.json"


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
}
