"""The inner-optimizer study's figures (docs/results.md, Which inner optimizer keeps its DP advantage as K
grows): the flagship sweep configs/sweeps/inner_optimizers.yaml, tuned per optimizer and K.

Source: experiments/paper_check/optimizer_results.json, written by
`python experiments/paper_check/optimizer_tables.py --root experiments/optimizers/results --json ...` from the
sweep's committed tuned.json. Print the guide's marked table with `python scripts/figures/inner.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package beside it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from figures import Figure, FigureError

SOURCE = "experiments/paper_check/optimizer_results.json"
OPTIMIZERS = {
    "adamw": "AdamW",
    "muon": "Muon",
    "lion": "Lion",
    "ademamix": "AdEMAMix",
    "Adafactor": "Adafactor",
}
KS = (1, 4, 8)


def _cell(data: dict, optimizer: str, k: int) -> dict:
    cell = data["gaps"].get(f"{optimizer}_k{k}")
    if cell is None:
        raise FigureError(f"no tuned result for {optimizer} at K = {k}")
    return cell


def gap(optimizer: str, k: int) -> Figure:
    """Mean gap to DP over the seeds, with its range over them."""

    def render(data: dict) -> str:
        c = _cell(data, optimizer, k)
        return f"{c['gap']:+.2f}% ({min(c['gaps']):+.2f}..{max(c['gaps']):+.2f})"

    return Figure(SOURCE, render)


def loss(optimizer: str, k: int) -> Figure:
    return Figure(SOURCE, lambda data: f"{_cell(data, optimizer, k)['loss']:.4f}")


def dp_loss(optimizer: str) -> Figure:
    return Figure(SOURCE, lambda data: f"{_cell(data, optimizer, 4)['dp']:.4f}")


def _best_at(data: dict, k: int, field: str) -> str:
    cells = {o: data["gaps"][f"{o}_k{k}"][field] for o in OPTIMIZERS if f"{o}_k{k}" in data["gaps"]}
    if not cells:
        raise FigureError(f"no results at K = {k}")
    return OPTIMIZERS[min(cells, key=cells.get)]


def best_per_k(field: str) -> Figure:
    """Which optimizer is lowest in `field` at each K, e.g. "Muon at every K" or "Muon at K = 1 and 4,
    Adafactor at K = 8"."""

    def render(data: dict) -> str:
        winners = {k: _best_at(data, k, field) for k in KS}
        if len(set(winners.values())) == 1:
            return f"{winners[KS[0]]} at every K"
        by: dict[str, list[int]] = {}
        for k, name in winners.items():
            by.setdefault(name, []).append(k)
        return ", ".join(f"{name} at K = {' and '.join(map(str, ks))}" for name, ks in by.items())

    return Figure(SOURCE, render)


FIGURES: dict[str, Figure] = {
    "inner.lowest_loss": best_per_k("loss"),
    "inner.smallest_gap": best_per_k("gap"),
}
for _opt in OPTIMIZERS:
    FIGURES[f"inner.{_opt}.dp_loss"] = dp_loss(_opt)
    for _k in KS:
        FIGURES[f"inner.{_opt}.k{_k}.gap"] = gap(_opt, _k)
        FIGURES[f"inner.{_opt}.k{_k}.loss"] = loss(_opt, _k)


def table() -> str:
    """docs/results.md's table, marked (docs_figures.py --write fills the values)."""

    def mark(name: str) -> str:
        return f"<!-- fig {name} -->?<!-- /fig -->"

    header = "| inner optimizer | " + " | ".join(f"gap to DP, K = {k}" for k in KS)
    header += " | loss K = 1 / 4 / 8 | DP loss |"
    lines = [header, "|---|" + "---|" * (len(KS) + 2)]
    for opt, label in OPTIMIZERS.items():
        gaps = " | ".join(mark(f"inner.{opt}.k{k}.gap") for k in KS)
        losses = " / ".join(mark(f"inner.{opt}.k{k}.loss") for k in KS)
        lines.append(f"| {label} | {gaps} | {losses} | {mark(f'inner.{opt}.dp_loss')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
