"""The sparse frontier's figures (issue 61), quoted by docs/results.md ("Sparse pseudogradients") and
docs/compression.md from experiments/paper_check/sparse_frontier_results.json (written by
`python experiments/paper_check/sparse_frontier.py --json ...`): one row per method, codec and K, with its
seeds' losses and each seed's difference to the same inner optimizer's fp32 run.
"""

from __future__ import annotations

import statistics

from figures import Figure, FigureError
from figures.wan import LABELS, link_figures, link_table, wan_runs

FRONTIER = "experiments/paper_check/sparse_frontier_results.json"
CURVES = (
    "experiments/wan/results/wan_sparse_curves.json"  # bench_wan.py --curves-only, the headline's schedule
)
TOPK = "top-k {}% of 4096, 2-bit"  # the study's chunked top-k rows at 2-bit values
TOPK4 = "top-k {}% of 4096, 4-bit"  # K = 4 only
DENSITIES = ("3.125", "1.5", "0.5")
CODECS = ("fp32", "4-bit", "2-bit + EF", *(t.format(d) for d in DENSITIES for t in (TOPK, TOPK4)))


def _row(rows: list[dict], workers: int, method: str, codec: str) -> dict:
    for row in rows:
        if (row["workers"], row["method"], row["codec"]) == (workers, method, codec):
            return row
    raise FigureError(f"no row K = {workers}, {method}, {codec} in {FRONTIER}")


def _signed(diffs: list[float]) -> str:
    """A mean over the seeds and each seed's: '+9.47% (+9.03 / +9.90)'."""
    return f"{statistics.mean(diffs):+.2f}% ({' / '.join(f'{d:+.2f}' for d in diffs)})"


def _vs_fp32(workers: int, method: str, codec: str) -> Figure:
    return Figure(FRONTIER, lambda rows: _signed(_row(rows, workers, method, codec)["vs_fp32_pct"]))


def _message(workers: int, method: str, codec: str) -> Figure:
    """fp32's payload per sync over the row's."""
    return Figure(FRONTIER, lambda rows: f"{_row(rows, workers, method, codec)['message_x']:.0f}x")


def _megabytes(workers: int, method: str, codec: str) -> Figure:
    return Figure(FRONTIER, lambda rows: f"{_row(rows, workers, method, codec)['mb_per_worker']:.2f} MB")


def _against(workers: int, a: tuple[str, str], b: tuple[str, str]) -> Figure:
    """Row a's loss over row b's, seed by seed: '-0.81% / +0.90%' (the seeds both ran)."""

    def render(rows: list[dict]) -> str:
        x, y = _row(rows, workers, *a), _row(rows, workers, *b)
        theirs = dict(zip(y["seeds"], y["losses"], strict=True))
        pairs = [(loss, theirs[s]) for s, loss in zip(x["seeds"], x["losses"], strict=True) if s in theirs]
        return " / ".join(f"{100 * (p / q - 1):+.2f}%" for p, q in pairs)

    return Figure(FRONTIER, render)


def _bytes_ratio(workers: int, a: tuple[str, str], b: tuple[str, str]) -> Figure:
    return Figure(
        FRONTIER,
        lambda rows: (
            f"{_row(rows, workers, *a)['mb_per_worker'] / _row(rows, workers, *b)['mb_per_worker']:.2f}x"
        ),
    )


def _sparseloco_vs_diloco(workers: int) -> Figure:
    """SparseLoCo as published against DiLoCo fp32 (both AdamW inside): the paper's 'beats DiLoCo'."""
    return Figure(
        FRONTIER, lambda rows: _signed(_row(rows, workers, "SparseLoCo", TOPK.format("3.125"))["vs_fp32_pct"])
    )


def _table(rows: list[dict]) -> str:
    """The frontier at both K: each codec's message size and every row against its own fp32, per seed."""
    lines = [
        "",
        "| method | pseudogradient | message | K = 4: vs fp32 (seed 0 / 1) | K = 8: vs fp32 (seed 0 / 1) |",
        "|---|---|---|---|---|",
    ]
    for method in ("DiLoCo", "MuLoCo", "SparseLoCo", "SparseLoCo + Muon"):
        for codec in CODECS:
            found = [r for r in rows if (r["method"], r["codec"]) == (method, codec)]
            if not found:
                continue
            cells = []
            for workers in (4, 8):
                row = next((r for r in found if r["workers"] == workers), None)
                if row is None:
                    cells.append("not run")
                elif codec == "fp32":
                    cells.append(" / ".join(f"{v:.4f}" for v in row["losses"]))
                else:
                    cells.append(_signed(row["vs_fp32_pct"]))
            message = "1x (loss)" if codec == "fp32" else f"{found[0]['message_x']:.0f}x"
            lines.append(f"| {method} | {codec} | {message} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def _to_target(data: dict, key: str) -> tuple[int, float]:
    """`key`'s chosen curve run: the first evaluated step at or below DDP's final loss, and the bytes per
    worker sent by then (syncs are evenly spaced, so the run's bytes pro rata)."""
    curve = data["curves"][key]
    run = next(r for r in curve["runs"] if r["steps"] == curve["steps"])
    hit = next((e["step"] for e in run["evals"] if e["val_loss"] <= data["target_val_loss"]), None)
    if hit is None:
        raise FigureError(f"{key} never reaches DDP's loss in {CURVES}")
    return hit, run["bytes_sent_per_worker"] * hit / run["steps"]


def _curve_figures() -> dict[str, Figure]:
    def steps_vs_ddp(data: dict) -> str:
        return f"{_to_target(data, 'muloco_sparse')[0] / data['curves']['ddp']['steps']:.2f}x"

    def per_sync(data: dict) -> str:
        run = data["curves"]["muloco_sparse"]["runs"][-1]
        return f"{run['bytes_sent_per_worker'] / run['syncs'] / 1e3:.1f} KB"

    def fewer(data: dict) -> str:
        return f"{_to_target(data, 'muloco_4bit')[1] / _to_target(data, 'muloco_sparse')[1]:.1f}x"

    return {
        "sparse.wan.horizon": Figure(CURVES, lambda d: f"{d['curves']['muloco_sparse']['horizon']:g}x"),
        "sparse.wan.steps_vs_ddp": Figure(CURVES, steps_vs_ddp),
        "sparse.wan.per_sync": Figure(CURVES, per_sync),
        "sparse.wan.mb": Figure(CURVES, lambda d: f"{_to_target(d, 'muloco_sparse')[1] / 1e6:.2f} MB"),
        "sparse.wan.mb_4bit": Figure(CURVES, lambda d: f"{_to_target(d, 'muloco_4bit')[1] / 1e6:.1f} MB"),
        "sparse.wan.fewer_than_4bit": Figure(CURVES, fewer),
        "sparse.wan.target": Figure(CURVES, lambda d: f"{d['target_val_loss']:.4f}"),
    }


MUON_TOPK3 = ("MuLoCo", TOPK.format("3.125"))
MUON_TOPK15 = ("MuLoCo", TOPK.format("1.5"))
SPARSELOCO = ("SparseLoCo", TOPK.format("3.125"))
SPARSELOCO_MUON = ("SparseLoCo + Muon", TOPK.format("3.125"))

FIGURES: dict[str, Figure] = {
    "sparse.table": Figure(FRONTIER, _table),
    "sparse.muloco_topk3_k4": _vs_fp32(4, *MUON_TOPK3),
    "sparse.muloco_topk3_k8": _vs_fp32(8, *MUON_TOPK3),
    "sparse.muloco_topk3_message": _message(4, *MUON_TOPK3),
    "sparse.muloco_topk05_k4": _vs_fp32(4, "MuLoCo", TOPK.format("0.5")),
    "sparse.muloco_topk05_message": _message(4, "MuLoCo", TOPK.format("0.5")),
    "sparse.diloco_topk3_k4": _vs_fp32(4, "DiLoCo", TOPK.format("3.125")),
    "sparse.diloco_topk3_k8": _vs_fp32(8, "DiLoCo", TOPK.format("3.125")),
    "sparse.sparseloco_k4": _sparseloco_vs_diloco(4),
    "sparse.sparseloco_k8": _sparseloco_vs_diloco(8),
    "sparse.sparseloco_message": _message(4, *SPARSELOCO),
    "sparse.sparseloco_mb": _megabytes(4, *SPARSELOCO),
    "sparse.muloco_topk15_mb": _megabytes(4, *MUON_TOPK15),
    "sparse.equal_bytes_k4": _against(4, MUON_TOPK15, SPARSELOCO),
    "sparse.equal_bytes_k8": _against(8, MUON_TOPK15, SPARSELOCO),
    "sparse.equal_bytes_ratio": _bytes_ratio(4, MUON_TOPK15, SPARSELOCO),
    "sparse.muon_rule_k4": _against(4, MUON_TOPK3, SPARSELOCO_MUON),
    "sparse.muon_rule_k8": _against(8, MUON_TOPK3, SPARSELOCO_MUON),
    **_curve_figures(),
}


# -- the sparse row over the headline's links (bench_wan.py, 3 interleaved repeats a ratio) ---------------
LINKS = {
    50: "experiments/wan/results/wan_sparse_r50.json",
    5: "experiments/wan/results/wan_sparse_r5.json",
}
LINK_ROWS = ("ddp", "ddp_bf16", "muloco_4bit", "muloco_sparse")
LINK_LABELS = {**LABELS, "muloco_sparse": "MuLoCo sparse 3.125% 2-bit (SparseLoCo's rule)"}


def _over(key: str, other: str, ratio: float, field: str) -> Figure:
    """`key`'s median `field` at `ratio` over `other`'s (e.g. the sparse row's time over MuLoCo 4-bit's)."""

    def render(data: dict) -> str:
        mine = statistics.median(r[field] for r in wan_runs(data, key, ratio))
        theirs = statistics.median(r[field] for r in wan_runs(data, other, ratio))
        return f"{mine / theirs:.2f}x"

    return Figure(LINKS[ratio], render)


FIGURES.update(link_figures("sparse.links", LINKS, LINK_ROWS))
for _ratio in LINKS:
    FIGURES[f"sparse.links.r{_ratio:g}.time_vs_4bit"] = _over(
        "muloco_sparse", "muloco_4bit", _ratio, "s_to_target"
    )


# one loss curve per row serves both ratios: the steps are the same at each
FIGURES["sparse.links.r50.steps_vs_4bit"] = _over("muloco_sparse", "muloco_4bit", 50, "steps_to_target")


def links_table() -> str:
    """docs/wan.md's table of the sparse row over the links, marked (docs_figures.py --write fills it)."""
    return link_table("sparse.links", LINKS, LINK_ROWS, LINK_LABELS)
