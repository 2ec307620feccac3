"""The science figures: what docs/results.md, docs/optimizers.md, docs/quickstart.md, docs/simulation.md and
docs/sweeps.md quote from the studies and benchmarks (scripts/docs_figures.py).

Sources are committed JSONs: the pico study's tables (experiments/paper_check/pico_results.json, written by
`python experiments/paper_check/pico_tables.py --json`; its tables are markdown strings, read here cell by
cell), the transport study (transport_results.json), the streaming runs, the catalogue survey and the
benchmarks. A figure is a cell or a field, formatted, or a derivation done here (a mean over seeds, a ratio
of two losses). Studies whose raw results are not committed (the inner-optimizer study's alignment runs,
the quickstart-scale study) have no figure here: docs/records/results.md keeps their tables. The
inner-optimizer study's gaps are figures/inner.py's.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from typing import Any

from figures import Figure, FigureError

PICO = "experiments/paper_check/pico_results.json"
TRANSPORT = "experiments/paper_check/transport_results.json"
RESULTS = "experiments/benchmarks/results"
STREAMING = (f"{RESULTS}/streaming.json", f"{RESULTS}/streaming_seed1.json")  # seeds 0 and 1
SURVEY = "experiments/optimizers/results/catalogue_survey.json"
MUON = f"{RESULTS}/bench_muon.json"
GRAM_BLOCK = f"{RESULTS}/bench_gram_block.json"  # deterministic, no timing
BATCHED_STEP = f"{RESULTS}/bench_batched_step.json"
BATCHED_FORWARD = f"{RESULTS}/bench_batched_forward.json"
PAIRED_MUON = f"{RESULTS}/bench_simulation_paired_muon.json"
THREADS = f"{RESULTS}/bench_threads_under_load.json"
PROCESS_START = f"{RESULTS}/bench_process_start.json"

# pico_results.json's tables, by their titles there
GAP_VS_K = "Gap to DP vs K (each at its tuned lr)"
OUTER_STEPS = "Gap vs outer steps (K = 4, H = 15)"
WORKER_BATCH = "Gap vs per-worker batch at 3.1M tokens (K = 4)"
K1_BATCH = "K = 1 vs DP across global batch (3.1M tokens)"
MUON_SETTINGS = "Muon settings (K = 4 and DP, lr 0.02)"
COMPRESSION = "Compression (K = 4, H = 15, 100 outer steps)"
NANO = "A larger model (nano, K = 4, 100 outer steps)"
RETUNE = "Quickstart regime (nano, 10 outer steps), K = 4 at several lrs"
ALIGNMENT = "Alignment (mean over the second half of the syncs, 30 outer steps)"
METHODS = {"diloco": "DiLoCo (AdamW)", "muloco": "MuLoCo (Muon)"}
PAPER_RECIPE = "nesterov=false, ns=muloco, wd=0, qkv=fused"
PAPER_RECIPE_WD = "nesterov=false, ns=muloco, wd=0.1, qkv=fused"
OURS = "nesterov=true, ns=keller, wd=0, qkv=fused"
SPLIT = "nesterov=true, ns=keller, wd=0, qkv=split"


# -- pico_results.json: markdown tables, cell by cell ------------------------------------------------------
def _diverged_count(summary: dict) -> str:
    return f"{len(summary['diverged'])} of {summary['cases']}"


def _tables(text: str) -> list[list[list[str]]]:
    """A markdown string's tables, each a list of rows (the header first, the --- row dropped)."""
    tables = []
    for block in text.strip().split("\n\n"):
        lines = [line.strip() for line in block.splitlines() if line.strip().startswith("|")]
        rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
        tables.append([rows[0], *rows[2:]])
    return tables


def _pico_cell(d: dict, title: str, where: dict[int, str], col: int) -> str:
    """The cell in column `col` of the row of table `title` whose columns match `where`."""
    if title not in d["tables"]:
        raise FigureError(f"no table {title!r} in {PICO}")
    for table in _tables(d["tables"][title]):
        for row in table[1:]:
            if all(row[i] == v for i, v in where.items()):
                return row[col]
    raise FigureError(f"no row {where} in table {title!r}")


def _number(cell: str) -> float:
    """The first number of a cell: '1.4505 (lr 0.006)' -> 1.4505, '+13.74%' -> 13.74."""
    m = re.search(r"[-+]?\d+(?:\.\d+)?", cell)
    if m is None:
        raise FigureError(f"no number in {cell!r}")
    return float(m[0])


def _cell(title: str, where: dict[int, str], col: int) -> Figure:
    """A cell as the table gives it."""
    return Figure(PICO, lambda d: _pico_cell(d, title, where, col))


def _gap_vs_k(method: str, k: int) -> Figure:
    """The gap to DP over the 2 seeds and each seed's: '+13.74% (+13.10% / +14.38%)'."""

    def render(d: dict) -> str:
        where = {0: METHODS[method], 1: str(k)}
        return f"{_pico_cell(d, GAP_VS_K, where, 6)} ({_pico_cell(d, GAP_VS_K, where, 7)})"

    return Figure(PICO, render)


def _seed_spread(d: dict) -> str:
    """The largest difference between the two seeds' gaps over the gap-vs-K rows, in points."""
    spreads = []
    for method in METHODS.values():
        for k in ("1", "4", "8"):
            a, b = (_number(s) for s in _pico_cell(d, GAP_VS_K, {0: method, 1: k}, 7).split("/"))
            spreads.append(abs(a - b))
    return f"{max(spreads):.1f} points"


def _ratio(title: str, a: dict[int, str], b: dict[int, str], col: int) -> Figure:
    """How much the loss of row `a` is above row `b`'s, in column `col`: (a / b - 1) x 100."""

    def render(d: dict) -> str:
        x, y = (_number(_pico_cell(d, title, where, col)) for where in (a, b))
        return f"{(x / y - 1) * 100:+.2f}%"

    return Figure(PICO, render)


def _compression_mean(method: str, scheme: str) -> Figure:
    """The mean over the 2 seeds of the same-seed difference to fp32."""

    def render(d: dict) -> str:
        cell = _pico_cell(d, COMPRESSION, {0: METHODS[method], 1: scheme}, 3)
        return f"{statistics.mean(_number(s) for s in cell.split('/')):+.2f}%"

    return Figure(PICO, render)


def _retune_best(method: str) -> Figure:
    """The quickstart regime at K = 4: the gap of the best of the lrs tried ('lr: loss (gap) · ...')."""

    def render(d: dict) -> str:
        cell = _pico_cell(d, RETUNE, {0: METHODS[method]}, 2)
        gaps = re.findall(r"\(([-+]\d+\.\d+)%\)", cell)
        if not gaps:
            raise FigureError(f"no gaps in {cell!r}")
        return f"{min(float(g) for g in gaps):+.2f}%"

    return Figure(PICO, render)


def _nano_gap(method: str) -> Figure:
    return _cell(NANO, {0: METHODS[method]}, 3)


# -- transport_results.json: the bytes target at H = 30 (quickstart model, 2 seeds) ------------------------
def _qs_row(d: dict, transport: str, mean_bits: int | None) -> dict:
    for row in d["quickstart"]:
        if row["run"] == "2-bit" and row["transport"] == transport and row["mean_bits"] == mean_bits:
            return row
    raise FigureError(f"no quickstart row 2-bit {transport} means {mean_bits}")


def _qs_loss(transport: str, mean_bits: int | None) -> Figure:
    return Figure(
        TRANSPORT, lambda d: f"{statistics.mean(_qs_row(d, transport, mean_bits)['vs_fp32_pct']):+.2f}%"
    )


def _qs_fewer(transport: str, mean_bits: int | None) -> Figure:
    """How many times fewer bytes per worker than DDP at equal tokens."""

    def render(d: dict) -> str:
        row = _qs_row(d, transport, mean_bits)
        return f"{row['ddp_mb'] / row['mb_sent']:.0f}x"

    return Figure(TRANSPORT, render)


# -- streaming.json, streaming_seed1.json (nano with 6 blocks, K = 4, H = 15, 2 seeds) ---------------------
def _stream_runs(data: Any, case: str) -> dict:
    for run in data["runs"]:
        if run["case"] == case:
            return run
    raise FigureError(f"no streaming run {case!r}")


def _streaming(render: Callable[[list[dict], list[dict]], str]) -> Figure:
    """A figure of both seeds: render(runs of seed 0, runs of seed 1). The source is seed 0's JSON; seed 1's
    is read beside it (both are committed)."""
    import json
    from pathlib import Path

    def value(d: dict) -> str:
        seed1 = Path(__file__).resolve().parents[2] / STREAMING[1]
        if not seed1.exists():
            raise FigureError(f"its source {STREAMING[1]} is missing")
        return render(d, json.loads(seed1.read_text()))

    return Figure(STREAMING[0], value)


def _stream_diff(case: str) -> Figure:
    """The mean over the seeds of the final val loss's difference to plain MuLoCo."""
    return _streaming(
        lambda a, b: (
            f"{statistics.mean(_stream_runs(x, case)['val_loss_diff_vs_plain'] for x in (a, b)):+.3f}"
        )
    )


def _stream_diff_pct(case: str) -> Figure:
    def render(a: dict, b: dict) -> str:
        diff = statistics.mean(_stream_runs(x, case)["val_loss_diff_vs_plain"] for x in (a, b))
        plain = statistics.mean(_stream_runs(x, "MuLoCo")["final_val_loss"] for x in (a, b))
        return f"{diff / plain * 100:+.1f}%"

    return _streaming(render)


def _stream_wait(case: str) -> Figure:
    """The projected share of the run spent waiting on a 100 Mbit/s link, seed 0 / seed 1."""
    return _streaming(
        lambda a, b: " / ".join(
            f"{_stream_runs(x, case)['projected_network_wait_fraction'] * 100:.1f}%" for x in (a, b)
        )
    )


# -- catalogue_survey.json ---------------------------------------------------------------------------------
def _survey_count(outcome: str) -> Figure:
    return Figure(SURVEY, lambda d: str(sum(r["outcome"] == outcome for r in d["rows"])))


def _survey_seconds(name: str) -> Figure:
    return Figure(SURVEY, lambda d: f"{next(r['seconds'] for r in d['rows'] if r['name'] == name):.0f} s")


# -- benchmarks ----------------------------------------------------------------------------------------------
def _batched_step(inner: str) -> Figure:
    def render(d: dict) -> str:
        row = next((r for r in d["rows"] if r["inner"] == inner), None)
        if row is None:
            raise FigureError(f"no row {inner}")
        return f"{row['speedup_median']:.2f}x"

    return Figure(BATCHED_STEP, render)


def _forward_vs_loop(way: str) -> Figure:
    """A way's speed over the loop's (ms of the loop / ms of the way)."""

    def render(d: dict) -> str:
        ms = {r["way"]: r["ms"] for r in d["rows"]}
        return f"{ms['one after another'] / ms[way]:.2f}x"

    return Figure(BATCHED_FORWARD, render)


def _paired(seqs: int, case: str) -> Figure:
    def render(d: dict) -> str:
        row = next((r for r in d["tables"][str(seqs)] if r["case"] == case), None)
        if row is None:
            raise FigureError(f"no row {case!r} at {seqs} sequences")
        return f"{row['ratio_to_dp']:.3f}x"

    return Figure(PAIRED_MUON, render)


def _threads(case: str) -> Figure:
    return Figure(THREADS, lambda d: f"{next(r['vs_idle'] for r in d['rows'] if r['case'] == case):.1f}x")


def _preload_saving(d: dict) -> str:
    """The CPU seconds a run spares when forked from the preloaded server: (fresh - preloaded) / runs."""
    rows = d["rows"]
    return f"{(rows['fresh']['cpu_median'] - rows['preloaded']['cpu_median']) / d['runs']:.1f} s"


FIGURES = {
    # docs/results.md: the gap to DP vs K (pico, 2 seeds)
    **{f"science.pico.gap.{m}_k{k}": _gap_vs_k(m, k) for m in METHODS for k in (1, 4, 8)},
    "science.pico.gap.seed_spread": Figure(PICO, _seed_spread),
    "science.pico.loss.muloco_k8": _cell(GAP_VS_K, {0: METHODS["muloco"], 1: "8"}, 4),
    "science.pico.loss.dp_adamw": Figure(
        PICO, lambda d: f"{_number(_pico_cell(d, GAP_VS_K, {0: METHODS['diloco'], 1: '8'}, 5)):.4f}"
    ),
    # the gap vs outer steps (K = 4, 1 seed a budget)
    **{
        f"science.pico.outer{n}.{m}": _cell(OUTER_STEPS, {7: str(n)}, col)
        for n in (10, 30, 100, 200)
        for m, col in (("diloco", 3), ("muloco", 6))
    },
    # per-worker batch (K = 4, 1 seed)
    **{
        f"science.pico.batch4.{m}": _cell(WORKER_BATCH, {0: "4"}, col)
        for m, col in (("diloco", 3), ("muloco", 6))
    },
    # K = 1 at large global batches (1 seed)
    **{
        f"science.pico.k1_{n}.{m}": _cell(K1_BATCH, {0: str(n)}, col)
        for n in (128, 512)
        for m, col in (("diloco", 3), ("muloco", 6))
    },
    # the quickstart regime tuned at K = 4 (nano, 10 outer steps, 1 seed)
    "science.retune.diloco": _retune_best("diloco"),
    "science.retune.muloco": _retune_best("muloco"),
    # a larger model (nano, 1 seed)
    "science.nano.diloco": _nano_gap("diloco"),
    "science.nano.muloco": _nano_gap("muloco"),
    # Muon settings (K = 4 and DP, 1 seed): the gaps, and each change's effect on the loss
    "science.muon.gap_paper": _cell(MUON_SETTINGS, {0: PAPER_RECIPE}, 3),
    "science.muon.gap_ours": _cell(MUON_SETTINGS, {0: OURS}, 3),
    "science.muon.gap_split": _cell(MUON_SETTINGS, {0: SPLIT}, 3),
    "science.muon.paper_vs_ours_k4": _ratio(MUON_SETTINGS, {0: PAPER_RECIPE}, {0: OURS}, 1),
    "science.muon.paper_vs_ours_dp": _ratio(MUON_SETTINGS, {0: PAPER_RECIPE}, {0: OURS}, 2),
    "science.muon.wd_k4": _ratio(MUON_SETTINGS, {0: PAPER_RECIPE_WD}, {0: PAPER_RECIPE}, 1),
    "science.muon.wd_dp": _ratio(MUON_SETTINGS, {0: PAPER_RECIPE_WD}, {0: PAPER_RECIPE}, 2),
    "science.muon.split_k4": _ratio(MUON_SETTINGS, {0: SPLIT}, {0: OURS}, 1),
    "science.muon.split_dp": _ratio(MUON_SETTINGS, {0: SPLIT}, {0: OURS}, 2),
    # compressed pseudogradients (K = 4, 100 outer steps, 2 seeds): seed 0 / seed 1 vs fp32, and means
    **{
        f"science.compression.{m}_{key}": _cell(COMPRESSION, {0: METHODS[m], 1: scheme}, 3)
        for m in METHODS
        for key, scheme in (("4bit", "4-bit"), ("2bit", "2-bit"), ("2bit_ef", "2-bit + EF"))
    },
    "science.compression.muloco_4bit_mean": _compression_mean("muloco", "4-bit"),
    "science.compression.diloco_4bit_mean": _compression_mean("diloco", "4-bit"),
    # alignment at K = 4 (30 outer steps, 1 seed)
    **{
        f"science.alignment.{inner}.{key}": _cell(ALIGNMENT, {0: inner, 1: "4"}, col)
        for inner in ("adamw", "muon")
        for key, col in (("pairwise", 2), ("sigma1", 6), ("erank", 7))
    },
    # the transports' bytes target at H = 30 (quickstart model, 2 seeds)
    "science.transport.qs_ag_loss": _qs_loss("all_gather", None),
    "science.transport.qs_ag_fewer": _qs_fewer("all_gather", None),
    "science.transport.qs_rs2_loss": _qs_loss("reduce_scatter", 2),
    "science.transport.qs_rs2_fewer": _qs_fewer("reduce_scatter", 2),
    "science.transport.qs_rs4_loss": _qs_loss("reduce_scatter", 4),
    "science.transport.qs_rs4_fewer": _qs_fewer("reduce_scatter", 4),
    # streaming (nano with 6 blocks, K = 4, 2 seeds); the waits are projected at 100 Mbit/s
    "science.streaming.tau0_diff": _stream_diff("streaming P=3 tau=0"),
    "science.streaming.tau2_diff": _stream_diff("streaming P=3 tau=2"),
    "science.streaming.tau2_pct": _stream_diff_pct("streaming P=3 tau=2"),
    "science.streaming.peak": _streaming(
        lambda a, b: f"{_stream_runs(a, 'streaming P=3 tau=2')['peak_ratio']:.3f}x"
    ),
    "science.streaming.wait_plain": _stream_wait("MuLoCo"),
    "science.streaming.wait_tau2": _stream_wait("streaming P=3 tau=2"),
    # docs/optimizers.md: the catalogue survey, bench_muon.json
    "science.optim.survey_trains": _survey_count("trains, resumes bitwise"),
    "science.optim.survey_refused": _survey_count("refused"),
    "science.optim.survey_kron_s": _survey_seconds("kron"),
    "science.optim.survey_total": Figure(
        SURVEY, lambda d: f"{sum(r.get('seconds', 0) for r in d['rows']) / 60:.0f} minutes"
    ),
    "science.optim.bf16_gflops": Figure(
        MUON, lambda d: f"{d['matmul_gflops']['torch.bfloat16']:.0f} GFLOP/s"
    ),
    "science.optim.fp32_gflops": Figure(MUON, lambda d: f"{d['matmul_gflops']['torch.float32']:.0f} GFLOP/s"),
    "science.optim.bf16_speedup": Figure(
        MUON, lambda d: f"{d['matmul_gflops']['torch.bfloat16'] / d['matmul_gflops']['torch.float32']:.1f}x"
    ),
    "science.optim.gram2_excess": Figure(
        GRAM_BLOCK, lambda d: "{:.1f}".format(d["summary"]["gram_block_2"]["max_excess_pp"])
    ),
    "science.optim.gram2_diverged": Figure(
        GRAM_BLOCK, lambda d: _diverged_count(d["summary"]["gram_block_2"])
    ),
    "science.optim.gram3_diverged": Figure(
        GRAM_BLOCK, lambda d: _diverged_count(d["summary"]["gram_block_3"])
    ),
    "science.optim.gram_gflop": Figure(MUON, lambda d: f"{d['ns_gflop_per_step']['ours keller 5 auto']:.0f}"),
    "science.optim.standard_gflop": Figure(
        MUON, lambda d: f"{d['ns_gflop_per_step']['standard (ours standard, torch)']:.0f}"
    ),
    "science.optim.gram_saving": Figure(
        MUON,
        lambda d: "{:+.0f}%".format(
            (
                d["ns_gflop_per_step"]["ours keller 5 auto"]
                / d["ns_gflop_per_step"]["standard (ours standard, torch)"]
                - 1
            )
            * 100
        ),
    ),
    "science.optim.muloco4_flops": Figure(
        MUON,
        lambda d: "{:.2f}x".format(
            d["ns_gflop_per_step"]["ours muloco 4 auto"]
            / d["ns_gflop_per_step"]["standard (ours standard, torch)"]
        ),
    ),
    # docs/quickstart.md: threads on a busy machine
    "science.quickstart.busy_default": _threads("1 burner, default threads"),
    "science.quickstart.busy_one_thread": _threads("1 burner, train.threads=1"),
    # docs/simulation.md
    "science.sim.batched_step_muon": _batched_step("muon"),
    "science.sim.batched_step_adamw": _batched_step("adamw"),
    "science.sim.vmap_vs_loop": _forward_vs_loop("vmap, one call"),
    "science.sim.k8_seq4_sequential": _paired(4, "diloco K=8 sequential"),
    "science.sim.k8_seq4_batched": _paired(4, "diloco K=8 batched"),
    # docs/sweeps.md
    "science.sweeps.preload_saving": Figure(PROCESS_START, _preload_saving),
}
