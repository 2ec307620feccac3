"""The benchmark figures the guides quote: docs/benchmarks.md's headline figures and the measured figures of
docs/compression.md, docs/transport.md and docs/models.md (scripts/docs_figures.py).

Each source is a committed JSON the benchmark wrote (experiments/benchmarks/results/) or a study's results
(experiments/paper_check/). A figure is the JSON's own field, formatted, or a derivation done here (a mean
over same-seed pairs, a ratio of two fields, a min-max range); the dated tables stay in
docs/records/benchmarks.md. Print every value with `python scripts/docs_figures.py --list`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from figures import Figure, FigureError

RESULTS = "experiments/benchmarks/results"
COMPRESSION = f"{RESULTS}/bench_compression.json"  # 2 threads, 5 repeats
COMPRESSION_1T = f"{RESULTS}/bench_compression_1thread.json"  # 1 thread, 3 repeats
MUON = f"{RESULTS}/bench_muon.json"
SYNC_COST = f"{RESULTS}/bench_sync_cost.json"
COMPILE = f"{RESULTS}/bench_compile.json"
CONTROL_PLANE = f"{RESULTS}/control_plane.json"  # ae6fc48 vs 7a07d14 (the transport rule in)
CONTROL_PLANE_BEFORE = f"{RESULTS}/control_plane-7d4ee51.json"  # ae6fc48 vs 7d4ee51 (before the rule)
TRANSPORT_ERROR = f"{RESULTS}/bench_transport_error.json"
TRANSPORT_QUALITY = "experiments/paper_check/transport_results.json"
NORM = "experiments/paper_check/norm/tuned.json"
STAT_RANGE = f"{RESULTS}/bench_stat_range.json"  # deterministic, no timing
TOPK_CHUNKED = f"{RESULTS}/bench_topk_chunked.json"  # a 1B-entry pseudogradient, 3 interleaved repeats
SPARSELOCO = "chunked 3.125% 2-bit"  # SparseLoCo's codec (configs/sparseloco.yaml)
STREAMING = "streaming MuLoCo 4-bit P=3 tau=4"


def _fig(source: str, render: Callable[[Any], str]) -> Figure:
    return Figure(source, render)


def _row(rows: list[dict], key: str, value: str) -> dict:
    for row in rows:
        if row.get(key) == value:
            return row
    raise FigureError(f"no row with {key} = {value!r}")


def _range(values: list[float], fmt: str) -> str:
    if not values:
        raise FigureError("no values to take a range of")
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


# -- compression (bench_compression.py) ----------------------------------------------------------------
def _codec(source: str, codec: str, field: str, fmt: str) -> Figure:
    return _fig(source, lambda d: fmt.format(d["results"][codec][field]))


def _vs_hivemind(codec: str, field: str) -> Figure:
    return _fig(COMPRESSION, lambda d: "{:.2f}x".format(d["ratios"][codec][field]))


def _crc_share(d: dict) -> str:
    """The CRC32 on both sides over the 8-bit statistical row-wise encode + decode."""
    row = d["results"]["statistical 8b row"]
    return "{:.0f}%".format(100 * 2 * d["crc32_ms_8bit_payload"] / (row["encode_ms"] + row["decode_ms"]))


def _mse_over(d: dict, worse: str, better: str) -> str:
    return "{:.0f}x".format(d["results"][worse]["rel_mse"] / d["results"][better]["rel_mse"])


# -- chunked top-k on a 1B-entry pseudogradient (bench_topk_chunked.py) ----------------------------------
def _codec_row(codec: str, field: str, fmt: str) -> Figure:
    return _fig(TOPK_CHUNKED, lambda d: fmt.format(d["rows"][codec][field]))


def _per_gb(row: dict) -> str:
    """Median seconds per GB of fp32 (min-max over the repeats)."""
    lo, hi = row["s_per_gb_range"]
    return "{:.2f} s ({:.2f}-{:.2f})".format(row["s_per_gb"], lo, hi)


# -- the local cost per sync (bench_sync_cost.py) ------------------------------------------------------
def _pico_share(which: str) -> Figure:
    return _fig(
        SYNC_COST, lambda d: "{:.1f}%".format(100 * d["pico"]["table"][which]["sync_over_compute"]["median"])
    )


def _pico_revision(which: str) -> Figure:
    return _fig(SYNC_COST, lambda d: d["pico"]["table"][which]["revision"])


def _size_case(case: str, table: str = "results_kept_memory") -> Figure:
    return _fig(SYNC_COST, lambda d: "{:.1f} s".format(d["sizes"][table][case]["s_median"]))


# -- control plane (bench_control_plane.py): streaming under each transport -----------------------------
def _control(source: str, case: str, field: str) -> Figure:
    def render(d: dict) -> str:
        new = _row(d["rows"], "case", case)["new"]
        return (
            "{:.0f} ms".format(1000 * new["s_per_step"])
            if field == "ms"
            else "{:.0f}%".format(100 * new["wait"])
        )

    return _fig(source, render)


# -- the reduce-scatter's second quantization (bench_transport_error.py, one pico run per cell) -----------
def _error_rows(d: dict, *, owner_ef: bool, same_bits: bool = True) -> list[dict]:
    return [
        r
        for r in d["rows"]
        if r["transport"] == "reduce_scatter"
        and (r["mean_bits"] == r["bits"]) == same_bits
        and r["owner_ef"] is owner_ef
        and not (owner_ef and r["ef"])  # the workers' EF off, so that the owners' is the one difference
    ]


def _error_range(field: str, owner_ef: bool) -> Figure:
    return _fig(
        TRANSPORT_ERROR,
        lambda d: _range([r[field] for r in _error_rows(d, owner_ef=owner_ef)], "{:.2f}") + "x",
    )


# -- the transports in training (experiments/paper_check/transport_results.json: pico, 2 seeds) ---------
def _pairs(d: dict, bits: int, field: str) -> list[float]:
    return [x for r in d["pico"] if r["bits"] == bits for x in r[field]]


def _quality(bits: int, field: str) -> Figure:
    """The mean over same-seed pairs of the loss difference to the all-gather, in %."""

    def render(d: dict) -> str:
        values = _pairs(d, bits, field)
        if not values:
            raise FigureError(f"no {field} pairs at {bits} bits")
        return f"{statistics.mean(values):+.2f}%"

    return _fig(TRANSPORT_QUALITY, render)


def _quality_count(bits: int, field: str) -> Figure:
    return _fig(TRANSPORT_QUALITY, lambda d: str(len(_pairs(d, bits, field))))


def _owner_ef_cost(bits: int) -> Figure:
    """Owners' EF off minus on, paired by cell and seed (the cells run both: the workers' EF off)."""

    def render(d: dict) -> str:
        diffs = [
            off - on
            for r in d["pico"]
            if r["bits"] == bits and r["owners_ef_off_vs_all_gather_pct"]
            for off, on in zip(
                r["owners_ef_off_vs_all_gather_pct"], r["reduce_scatter_vs_all_gather_pct"], strict=True
            )
        ]
        if not diffs:
            raise FigureError(f"no owners' EF off pairs at {bits} bits")
        return f"{statistics.mean(diffs):+.2f}%"

    return _fig(TRANSPORT_QUALITY, render)


def _owner_ef_pairs(d: dict) -> str:
    cells = [r for r in d["pico"] if r["bits"] == 2 and r["owners_ef_off_vs_all_gather_pct"]]
    return str(sum(len(r["owners_ef_off_vs_all_gather_pct"]) for r in cells))


# -- LayerNorm or RMSNorm (experiments/paper_check/norm/tuned.json: pico, 2 seeds, each at its tuned lr) --
def _norm(d: dict, norm: str) -> dict:
    for row in d["rows"]:
        if row["cell"]["settings"]["model.norm"] == norm:
            return row
    raise FigureError(f"no row with model.norm = {norm}")


def _norm_gap(d: dict) -> str:
    ln, rms = _norm(d, "layernorm")["final_val_loss"], _norm(d, "rmsnorm")["final_val_loss"]
    return f"{100 * (ln / rms - 1):+.2f}%"


# -- model.compile (bench_compile.py) ----------------------------------------------------------------
def _compile_extra(d: dict) -> str:
    rows = d["rows"]
    return "{:.1f} s".format(
        _row(rows, "case", "dp compiled")["warmup_s"] - _row(rows, "case", "dp eager")["warmup_s"]
    )


def _stat_range_worst(bits: int) -> Figure:
    """The default r's worst relative-MSE ratio to the best r over the three kinds of rows; the figure
    fails when the default is no longer a minimax choice of the sweep."""

    def render(d: dict) -> str:
        res = d["bits"][str(bits)]
        if not res["default_is_minimax"]:
            raise FigureError(
                f"at {bits} bits the default r = {res['default_r']} is not the sweep's minimax r"
            )
        row = _row_by_r(res["rows"], res["default_r"])
        return "{:.2f}".format(row["worst_ratio"])

    return _fig(STAT_RANGE, render)


def _row_by_r(rows: list[dict], r: float) -> dict:
    for row in rows:
        if row["r"] == r:
            return row
    raise FigureError(f"no row with r = {r}")


def _compile_ratio(case: str) -> Figure:
    return _fig(
        COMPILE,
        lambda d: "{:.2f}x".format(statistics.median(_row(d["rows"], "case", case)["compiled_over_eager"])),
    )


FIGURES = {
    # docs/benchmarks.md's headline figures
    "bench.compression.stat8_throughput_vs_hivemind": _vs_hivemind(
        "statistical 8b row", "throughput_ratio_vs_uniform8"
    ),
    "bench.compression.stat8_mse_vs_hivemind": _vs_hivemind(
        "statistical 8b row", "rel_mse_ratio_vs_uniform8"
    ),
    "bench.compression.stat4_1thread_enc_dec": _codec(
        COMPRESSION_1T, "statistical 4b row", "encode_decode_GBps", "{:.2f} GB/s"
    ),
    "bench.muon.step_vs_torch": _fig(MUON, lambda d: "{:.2f}x".format(d["ratios"]["ours_over_torch_muon"])),
    "bench.sync_cost.pico_before": _pico_share("old"),
    "bench.sync_cost.pico_after": _pico_share("new"),
    "bench.sync_cost.pico_before_rev": _pico_revision("old"),
    "bench.sync_cost.pico_after_rev": _pico_revision("new"),
    "bench.sync_cost.1b_rs_4bit": _size_case("1B reduce_scatter 4-bit"),
    "bench.sync_cost.1b_ag_4bit": _size_case("1B all_gather 4-bit"),
    # docs/compression.md
    "bench.compression.topk_bits_fp32": _codec(COMPRESSION, "topk 1% v32", "bits_per_param", "{:.2f}"),
    "bench.compression.topk_bits_8bit": _codec(COMPRESSION, "topk 1% v8", "bits_per_param", "{:.2f}"),
    "bench.compression.crc_ms": _fig(COMPRESSION, lambda d: "{:.1f} ms".format(d["crc32_ms_8bit_payload"])),
    "bench.compression.crc_share": _fig(COMPRESSION, _crc_share),
    "bench.compression.stat_range_worst_8": _stat_range_worst(8),
    "bench.compression.stat_range_worst_4": _stat_range_worst(4),
    "bench.compression.stat_range_worst_2": _stat_range_worst(2),
    "bench.topk_chunked.bits_sparseloco": _codec_row(SPARSELOCO, "bits_per_entry", "{:.2f}"),
    "bench.topk_chunked.fewer_sparseloco": _codec_row(SPARSELOCO, "x_fewer_than_fp32", "{:.0f}x"),
    "bench.topk_chunked.s_per_gb_sparseloco": _fig(TOPK_CHUNKED, lambda d: _per_gb(d["rows"][SPARSELOCO])),
    "bench.topk_chunked.value_mse_2bit": _fig(
        TOPK_CHUNKED, lambda d: "{:.2f}x".format(d["kept_value_error"]["2"]["ours_over_reference"])
    ),
    "bench.compression.absmax8_more_accurate": _fig(
        COMPRESSION, lambda d: _mse_over(d, "statistical 8b row", "linear absmax 8b row")
    ),
    # docs/transport.md
    "bench.transport.link_rate": _fig(CONTROL_PLANE, lambda d: f"{d['rate_mbit']:g} Mbit/s"),
    "bench.transport.link_delay": _fig(CONTROL_PLANE, lambda d: f"{d['delay_ms']:g} ms"),
    "bench.transport.streaming_rs_ms": _control(CONTROL_PLANE_BEFORE, STREAMING, "ms"),
    "bench.transport.streaming_rs_wait": _control(CONTROL_PLANE_BEFORE, STREAMING, "wait"),
    "bench.transport.streaming_ag_ms": _control(CONTROL_PLANE, STREAMING, "ms"),
    "bench.transport.streaming_ag_wait": _control(CONTROL_PLANE, STREAMING, "wait"),
    "bench.transport.error_same_bits": _error_range("error_vs_all_gather", owner_ef=False),
    "bench.transport.drift_owner_ef_off": _error_range("drift_vs_all_gather", owner_ef=False),
    "bench.transport.drift_owner_ef_on": _error_range("drift_vs_all_gather", owner_ef=True),
    "bench.transport.pairs": _quality_count(4, "reduce_scatter_vs_all_gather_pct"),
    "bench.transport.same_bits_8": _quality(8, "reduce_scatter_vs_all_gather_pct"),
    "bench.transport.same_bits_4": _quality(4, "reduce_scatter_vs_all_gather_pct"),
    "bench.transport.same_bits_2": _quality(2, "reduce_scatter_vs_all_gather_pct"),
    "bench.transport.wider_4": _quality(4, "wider_vs_all_gather_pct"),
    "bench.transport.wider_2": _quality(2, "wider_vs_all_gather_pct"),
    "bench.transport.owner_ef_pairs": _fig(TRANSPORT_QUALITY, _owner_ef_pairs),
    "bench.transport.owner_ef_cost_4": _owner_ef_cost(4),
    "bench.transport.owner_ef_cost_2": _owner_ef_cost(2),
    # docs/models.md
    "bench.models.layernorm_vs_rmsnorm": _fig(NORM, _norm_gap),
    "bench.models.gap_to_dp_layernorm": _fig(
        NORM, lambda d: "{:+.2f}%".format(_norm(d, "layernorm")["pct_over_dp"])
    ),
    "bench.models.gap_to_dp_rmsnorm": _fig(
        NORM, lambda d: "{:+.2f}%".format(_norm(d, "rmsnorm")["pct_over_dp"])
    ),
    "bench.compile.warmup_extra": _fig(COMPILE, _compile_extra),
    "bench.compile.dp": _compile_ratio("dp compiled"),
    "bench.compile.diloco": _compile_ratio("diloco K=4 compiled"),
}
