"""The figures of the guides on running across real machines: docs/backends.md, deployment.md,
reliability.md, security.md and topology.md (scripts/docs_figures.py).

Each source is a committed JSON a benchmark, a repeat script or a study wrote: the backends' sync times
(experiments/benchmarks/results/hivemind.json, bench_torchft.json), the WAN headline's hivemind and torchft
rows (experiments/wan/results/wan_headline_repeats.json), the swarm's repeats under load
(experiments/reliability/results/), the robust rules' cost (experiments/paper_check/, bench_aggregate.json),
sharded workers and distributed Muon. The dated tables stay in docs/records/ (benchmarks.md, backends.md,
reliability.md). Print every value with `python scripts/docs_figures.py --list`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from figures import Figure, FigureError

RESULTS = "experiments/benchmarks/results"
RELIABILITY = "experiments/reliability/results"
HIVEMIND = f"{RESULTS}/hivemind.json"  # 3 peers on loopback, 10.9M parameters, median of 5
TORCHFT = f"{RESULTS}/bench_torchft.json"  # 3 workers on loopback, median of 5
HEADLINE = "experiments/wan/results/wan_headline_repeats.json"  # as scripts/figures/wan.py's
CONTROL_PROBE = f"{RESULTS}/control_plane_probe.json"  # 4 testbed hosts, 7.4 Mbit/s, 20 ms one way
MKL = f"{RESULTS}/bench_mkl_cbwr.json"  # a pico DDP step, 1 thread, 3 interleaved repeats
INTEGRITY = f"{RESULTS}/bench_checkpoint_integrity.json"  # the small preset's checkpoint, 5 repeats
AGGREGATE_TIME = f"{RESULTS}/bench_aggregate.json"  # 10.9M parameters, 2 cores, 5 repeats
AGGREGATE_HONEST = "experiments/paper_check/aggregate_results.json"  # pico regime, 2 seeds
INSIDER = "experiments/paper_check/insider_results.json"  # the tests' setting, 4 seeds
SHARDED = f"{RESULTS}/sharded.json"  # K = 2 workers x R ranks, 57.1M parameters, 3 repeats
DMUON = f"{RESULTS}/distributed_muon.json"  # one step of the d512/L6 matrices, 14 steps
PAYLOAD_BEFORE = f"{RELIABILITY}/payload_stress-loopback-before.json"
PAYLOAD_AFTER = f"{RELIABILITY}/payload_stress-loopback.json"
PAYLOAD_TESTBED = f"{RELIABILITY}/payload_stress-testbed-delay50ms.json"
# The seven swarm tests repeated under 2 burners at one swarm code state (c301f99, ad736ab, 8877b40: the
# swarm code, the hivemind backend, the trainer and the tests unchanged among the three).
SWARM_REPEATS = ("c301f99", "ad736ab", "8877b40")
KILLED_PEER = f"{RELIABILITY}/killed_peer_after_a_group_of_3-ae6fc48.json"


def _row(rows: list[dict], **match: Any) -> dict:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    raise FigureError(f"no row with {match}")


def _fig(source: str, render: Callable[[Any], str]) -> Figure:
    return Figure(source, render)


# -- hivemind and torchft against the torch backend, on loopback -------------------------------------------
def _hivemind(case: str, field: str, fmt: str, scale: float = 1.0) -> Figure:
    return _fig(HIVEMIND, lambda d: fmt.format(_row(d["rows"], case=case)[field] * scale))


def _torchft_ratio(case: str) -> Figure:
    return _fig(TORCHFT, lambda d: f"{_row(d['sync']['rows'], case=case)['ratio']:.2f}x")


def _torchft_failure(field: str) -> Figure:
    def render(d: dict) -> str:
        s = d["failure"]["summary"][field]
        return f"{s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f})"

    return _fig(TORCHFT, render)


# -- the WAN headline's swarm row ---------------------------------------------------------------------------
def _headline_steps_range(key: str, ratio: float) -> Figure:
    """`key`'s inner steps to DDP's loss over all its repeats at `ratio`, "min-max" (or one value)."""

    def render(d: dict) -> str:
        steps = [r["steps_to_target"] for r in d["rows"] if r["key"] == key and r["ratio"] == ratio]
        steps = [s for s in steps if s is not None]
        if not steps:
            raise FigureError(f"no row {key} at ratio {ratio:g} reached the target")
        lo, hi = min(steps), max(steps)
        return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"

    return _fig(HEADLINE, render)


def _headline_transport(key: str, ratio: float) -> Figure:
    return _fig(HEADLINE, lambda d: _row(d["rows"], key=key, ratio=ratio)["transport"])


# -- reliability --------------------------------------------------------------------------------------------
def _passed(source: str) -> Figure:
    """Runs passed of runs made, over every test a repeat_under_load.py JSON holds: "119 of 119"."""

    def render(d: dict) -> str:
        runs = [r for repeats in d["tests"].values() for r in repeats]
        return f"{sum(r['passed'] for r in runs)} of {len(runs)}"

    return _fig(source, render)


def _mismatches(source: str) -> Figure:
    """Downloads whose bytes did not hash to their token, of all downloads: "0 of 5,370"."""

    def render(d: dict) -> str:
        bad = sum(r["mismatched_downloads"] for r in d["runs"])
        return f"{bad:,} of {sum(r['downloads'] for r in d['runs']):,}"

    return _fig(source, render)


def _mkl(mode: str) -> Figure:
    def render(d: dict) -> str:
        row = _row(d["rows"], mode=mode)
        ms = [s * 1000 for s in row["step_s"]]
        return f"{row['median_s'] * 1000:.1f} ms ({min(ms):.1f}-{max(ms):.1f})"

    return _fig(MKL, render)


def _integrity(what: str) -> Figure:
    return _fig(INTEGRITY, lambda d: f"{_row(d['rows'], what=what)['median_s']:.3f} s")


# -- security -----------------------------------------------------------------------------------------------
def _honest_cost_max(d: list[dict]) -> str:
    """The largest cost of a robust rule when every worker is honest: the mean over seeds of the same-seed
    difference to the mean rule, the largest over methods, K and rules."""
    costs = [statistics.mean(r["vs_mean_pct"]) for r in d if r["rule"] != "mean"]
    return f"{max(costs):+.2f}%"


def _insider(workers: int, rule: str, fmt: str) -> Figure:
    """The final val loss of a run with one insider over the all-honest run of the same seed, min to max
    over the seeds."""

    def render(d: list[dict]) -> str:
        rel = [100 * (r[rule] / r["honest"] - 1) for r in d if r["workers"] == workers]
        if not rel:
            raise FigureError(f"no insider runs at K = {workers}")
        return f"{fmt.format(min(rel))} to {fmt.format(max(rel))}"

    return _fig(INSIDER, render)


def _seeds(d: list[dict]) -> str:
    return str(len({r["seed"] for r in d}))


def _aggregate_s(workers: int, rule: str) -> Figure:
    return _fig(AGGREGATE_TIME, lambda d: f"{_row(d['rows'], workers=workers, rule=rule)['median_s']:.3f} s")


# -- topology -----------------------------------------------------------------------------------------------
def _sharded(ranks: int, field: str, fmt: str = "{:.2f}x") -> Figure:
    """fsdp over replicate at the same R, the median over repeats of the per-repeat ratio."""
    return _fig(SHARDED, lambda d: fmt.format(_row(d["rows"], R=ranks)["ratio"][field]["median"]))


def _dmuon(ranks: int, field: str, fmt: str) -> Figure:
    return _fig(DMUON, lambda d: fmt.format(d["by_ranks"][str(ranks)][field]))


FIGURES: dict[str, Figure] = {
    # backends.md: a sync over hivemind against gloo's fp32 all-reduce (3 processes on loopback)
    "systems.hivemind.fp32_s": _hivemind("fp32", "hivemind_s", "{:.2f} s"),
    "systems.hivemind.4bit_s": _hivemind("4bit", "hivemind_s", "{:.2f} s"),
    "systems.hivemind.gloo_fp32_s": _hivemind("fp32", "gloo_s", "{:.3f} s"),
    "systems.hivemind.fp32_vs_gloo": _hivemind("fp32", "hivemind_vs_gloo_fp32", "{:.1f}x"),
    "systems.hivemind.4bit_vs_gloo": _hivemind("4bit", "hivemind_vs_gloo_fp32", "{:.1f}x"),
    "systems.hivemind.fp32_mb": _hivemind("fp32", "payload_mb_per_peer", "{:.1f} MB"),
    "systems.hivemind.4bit_mb": _hivemind("4bit", "payload_mb_per_peer", "{:.1f} MB"),
    # backends.md: torchft's sync against the torch backend's, its death and rejoin (loopback)
    "systems.torchft.fp32_vs_torch": _torchft_ratio("fp32"),
    "systems.torchft.4bit_vs_torch": _torchft_ratio("4bit"),
    "systems.torchft.death_to_sync": _torchft_failure("death_to_next_sync_s"),
    "systems.torchft.restart_to_sync": _torchft_failure("restart_to_first_sync_s"),
    # deployment.md, backends.md: the WAN headline's 4-bit rows at ratio 50 (4 namespaces, one machine)
    "systems.wan.hivemind_steps": _headline_steps_range("hivemind_4bit", 50.0),
    "systems.wan.torchft_steps": _headline_steps_range("torchft_4bit", 50.0),
    "systems.wan.torch_steps": _headline_steps_range("muloco_4bit", 50.0),
    "systems.wan.torch_transport": _headline_transport("muloco_4bit", 50.0),
    "systems.wan.hivemind_transport": _headline_transport("hivemind_4bit", 50.0),
    # reliability.md
    "systems.control.allreduce_1float": _fig(
        CONTROL_PROBE, lambda d: f"{d['collectives_s']['all_reduce 1 float'] * 1000:.0f} ms"
    ),
    "systems.control.link": _fig(
        CONTROL_PROBE, lambda d: f"{d['rate_mbit']:g} Mbit/s with {d['delay_ms']:g} ms one way"
    ),
    "systems.mkl.strict_vs_auto": _fig(
        MKL, lambda d: f"{_row(d['rows'], mode='AUTO,STRICT')['vs_auto']:.3f}x"
    ),
    "systems.mkl.strict_ms": _mkl("AUTO,STRICT"),
    "systems.mkl.auto_ms": _mkl("AUTO"),
    "systems.ckpt.mb": _fig(INTEGRITY, lambda d: f"{d['bytes'] / 1e6:.0f} MB"),
    "systems.ckpt.load_checked": _integrity("plain load (CRC-32 checked)"),
    "systems.ckpt.load_unchecked": _integrity("plain load, torch.load alone"),
    "systems.payload.before": _mismatches(PAYLOAD_BEFORE),
    "systems.payload.after": _mismatches(PAYLOAD_AFTER),
    "systems.payload.testbed": _mismatches(PAYLOAD_TESTBED),
    "systems.payload.testbed_link": _fig(PAYLOAD_TESTBED, lambda d: d["mode"].removeprefix("testbed ")),
    **{f"systems.swarm.{rev}": _passed(f"{RELIABILITY}/swarm_tests-{rev}.json") for rev in SWARM_REPEATS},
    "systems.swarm.killed_peer": _passed(KILLED_PEER),
    # security.md
    "systems.security.honest_cost_max": _fig(AGGREGATE_HONEST, _honest_cost_max),
    "systems.security.insider_seeds": _fig(INSIDER, _seeds),
    "systems.security.insider_mean_k4": _insider(4, "mean", "{:+.0f}%"),
    "systems.security.insider_mean_k8": _insider(8, "mean", "{:+.0f}%"),
    "systems.security.insider_trimmed_k4": _insider(4, "trimmed_mean", "{:+.2f}%"),
    "systems.security.insider_trimmed_k8": _insider(8, "trimmed_mean", "{:+.2f}%"),
    "systems.security.mean_k4_s": _aggregate_s(4, "mean"),
    "systems.security.trimmed_k4_s": _aggregate_s(4, "trimmed_mean"),
    "systems.security.trimmed_k8_s": _aggregate_s(8, "trimmed_mean"),
    "systems.security.cclip_k4_s": _aggregate_s(4, "centered_clip"),
    "systems.security.cclip_k8_s": _aggregate_s(8, "centered_clip"),
    # topology.md: sharded workers (fsdp over replicate at the same R) and distributed Muon (R over R = 1)
    "systems.sharded.r2_state": _sharded(2, "state", "{:.3f}x"),
    "systems.sharded.r4_state": _sharded(4, "state", "{:.3f}x"),
    "systems.sharded.r2_sent": _sharded(2, "sent"),
    "systems.sharded.r4_sent": _sharded(4, "sent"),
    "systems.sharded.r2_step": _sharded(2, "step_s"),
    "systems.sharded.r4_step": _sharded(4, "step_s"),
    "systems.sharded.r2_rss": _sharded(2, "rss"),
    "systems.sharded.r4_rss": _sharded(4, "rss"),
    "systems.dmuon.r1_step": _dmuon(1, "step_ms", "{:.0f} ms"),
    "systems.dmuon.r2_step": _dmuon(2, "step_ms", "{:.0f} ms"),
    "systems.dmuon.r2_step_ratio": _dmuon(2, "step_ratio", "{:.2f}x"),
    "systems.dmuon.r4_step_ratio": _dmuon(4, "step_ratio", "{:.2f}x"),
    "systems.dmuon.r2_state_ratio": _dmuon(2, "state_ratio", "{:.2f}x"),
    "systems.dmuon.r4_state_ratio": _dmuon(4, "state_ratio", "{:.2f}x"),
}
