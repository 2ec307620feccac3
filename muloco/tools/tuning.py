"""Tuned comparisons (a sweep's `tune: {over, per}`): each method at its own best setting against the DP
baseline at its own best setting, over paired seeds.

The runs are split into *cells*: one per method (DP or DiLoCo/MuLoCo) and per combination of the other
varied keys (the `per` keys first), so a best lr is never picked across a setting the sweep did not declare
tuned. Within a cell every combination of the `over` keys is a candidate:

- the best candidate is the lowest mean final loss over the seeds (`run.seed`) that *every* candidate of the
  cell ran, so a candidate run on more seeds is neither favoured nor penalised by them (a study that tunes on
  seed 0 and then repeats the winner on seed 1 chooses on seed 0);
- a best value at the lowest or highest value tried is flagged: the optimum may lie outside the grid;
- the DiLoCo/MuLoCo cell is compared with the DP cell of the same settings (the DP run ignores sync.*,
  outer.*, compression.*; without a DP cell at the same `workers`, the best DP cell at any K), over the seeds
  both best candidates ran: gap per seed = (loss / DP loss - 1) x 100, then their mean and range.

Pure functions over the report's run records (runs.py); the report draws the table, the JSON and the
plot.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from muloco.tools.runs import DP_BASELINE_FREE_PREFIXES, DP_IGNORED_PREFIXES, RunRecord, canonical

SEED_KEY = "run.seed"


@dataclass(frozen=True)
class TuneSpec:
    """What a sweep tuned (`over`: the keys searched) and per what (`per`: a best for each combination)."""

    over: tuple[str, ...]
    per: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, list[str]]:
        return {"over": list(self.over), "per": list(self.per)}


@dataclass
class TunedCell:
    """One method at one combination of settings, at its best candidate."""

    method: str  # "dp" or "diloco"
    settings: dict[str, Any]  # the cell's keys and values (per keys first)
    best: dict[str, Any]  # the winning value of each `over` key
    by_seed: dict[Any, RunRecord]  # the winning candidate's runs, by seed
    tried: dict[str, list[Any]]  # every value tried, per `over` key, sorted
    chosen_on: list[Any]  # the seeds the choice was made on
    warnings: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """A DiLoCo/MuLoCo cell at its best against its DP cell at its best, over their paired seeds."""

    cell: TunedCell
    dp: TunedCell | None
    seeds: list[Any]
    loss: float | None
    dp_loss: float | None
    gaps: list[float]  # % over DP, one per paired seed

    @property
    def gap(self) -> float | None:
        return statistics.mean(self.gaps) if self.gaps else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _sorted_values(values: list[Any]) -> list[Any]:
    unique = list({canonical(v): v for v in values}.values())
    if all(_number(v) for v in unique):
        return sorted(unique)
    return sorted(unique, key=canonical)


def setting(run: RunRecord, key: str) -> Any:
    """The run's value of `key` as it acts on the run: None where the run ignores the key (a DP run the
    sync, outer and compression settings; the built-in adamw inner.lr and Muon's fields: it reads
    inner.adamw.*), so runs that differ only there are the same candidate."""
    if run.is_dp_method and key.startswith(DP_IGNORED_PREFIXES):
        return None
    if (
        run.config.get("inner.optimizer") == "adamw"
        and key.startswith("inner.")
        and not key.startswith(("inner.adamw.", "inner.optimizer"))
    ):
        return None
    return run.config.get(key)


def cell_keys(varied: list[str], spec: TuneSpec) -> list[str]:
    """The keys that split runs into cells: the `per` keys, then every other varied key that is neither
    tuned nor the seed (method is always a split of its own)."""
    rest = [k for k in varied if k not in spec.over and k not in spec.per and k not in (SEED_KEY, "method")]
    return [*(k for k in spec.per if k != "method"), *rest]


def _edge_warnings(best: dict[str, Any], tried: dict[str, list[Any]]) -> list[str]:
    warnings = []
    for key, values in tried.items():
        if len(values) < 2 or not all(_number(v) for v in values):
            continue  # one value tried, or values without an order: no edge to sit on
        if best[key] == values[0]:
            warnings.append(f"{key}={best[key]:g} is the lowest tried: the optimum may lie below")
        elif best[key] == values[-1]:
            warnings.append(f"{key}={best[key]:g} is the highest tried: the optimum may lie above")
    return warnings


def _tune_cell(method: str, settings: dict[str, Any], runs: list[RunRecord], spec: TuneSpec) -> TunedCell:
    candidates: dict[str, dict[Any, RunRecord]] = {}
    values: dict[str, dict[str, Any]] = {}
    for run in runs:
        candidate = {k: setting(run, k) for k in spec.over}
        name = canonical(candidate)
        values[name] = candidate
        # A seed repeated at one candidate (a rerun under another name) keeps its lower-named run.
        candidates.setdefault(name, {}).setdefault(run.config.get(SEED_KEY), run)
    common = set.intersection(*(set(by_seed) for by_seed in candidates.values()))

    def score(name: str) -> float:
        by_seed = candidates[name]
        seeds = common or set(by_seed)  # no seed that all ran: each candidate's own
        return statistics.mean(by_seed[s].loss for s in seeds)

    winner = min(candidates, key=lambda name: (score(name), name))
    tried = {k: _sorted_values([v[k] for v in values.values()]) for k in spec.over}
    best = values[winner]
    return TunedCell(
        method=method,
        settings=settings,
        best=best,
        by_seed=candidates[winner],
        tried=tried,
        chosen_on=sorted(common, key=canonical),
        warnings=_edge_warnings(best, tried),
    )


def tune(runs: list[RunRecord], varied: list[str], spec: TuneSpec) -> list[TunedCell]:
    """Every cell at its best candidate, from the completed runs with a finite final loss."""
    keys = cell_keys(varied, spec)
    cells: dict[tuple[str, str], list[RunRecord]] = {}
    settings: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        if not run.completed or run.loss is None:
            continue
        method = "dp" if run.is_dp else "diloco"
        own = {k: setting(run, k) for k in keys}
        if method == "dp":
            own = {k: v for k, v in own.items() if not k.startswith(DP_BASELINE_FREE_PREFIXES)}
        key = (method, canonical(own))
        cells.setdefault(key, []).append(run)
        settings[key] = own
    return [_tune_cell(m, settings[(m, c)], members, spec) for (m, c), members in cells.items()]


def _dp_cell_for(cell: TunedCell, dp_cells: list[TunedCell]) -> TunedCell | None:
    wanted = {k: v for k, v in cell.settings.items() if not k.startswith(DP_BASELINE_FREE_PREFIXES)}
    for dp in dp_cells:
        if canonical(dp.settings) == canonical(wanted):
            return dp
    # No DP run at this K: the best DP cell that differs only in `workers` (DP's loss barely depends on K:
    # the same global batch and data).
    loose = {k: v for k, v in wanted.items() if k != "workers"}
    near = [
        dp
        for dp in dp_cells
        if canonical({k: v for k, v in dp.settings.items() if k != "workers"}) == canonical(loose)
    ]
    return min(near, key=lambda dp: statistics.mean(r.loss for r in dp.by_seed.values()), default=None)


def compare(cells: list[TunedCell]) -> list[Comparison]:
    """Each DiLoCo/MuLoCo cell against its DP cell, over the seeds both best candidates ran."""
    dp_cells = [c for c in cells if c.method == "dp"]
    out = []
    for cell in (c for c in cells if c.method == "diloco"):
        dp = _dp_cell_for(cell, dp_cells)
        if dp is None:
            seeds = sorted(cell.by_seed, key=canonical)
            loss = statistics.mean(cell.by_seed[s].loss for s in seeds)
            out.append(Comparison(cell, None, seeds, loss, None, []))
            continue
        seeds = sorted(set(cell.by_seed) & set(dp.by_seed), key=canonical)
        if not seeds:  # nothing paired: losses over each one's own seeds, no gap
            own = statistics.mean(r.loss for r in cell.by_seed.values())
            dp_own = statistics.mean(r.loss for r in dp.by_seed.values())
            out.append(Comparison(cell, dp, [], own, dp_own, []))
            continue
        losses = [cell.by_seed[s].loss for s in seeds]
        dp_losses = [dp.by_seed[s].loss for s in seeds]
        gaps = [(a / b - 1.0) * 100.0 for a, b in zip(losses, dp_losses, strict=True)]
        out.append(Comparison(cell, dp, seeds, statistics.mean(losses), statistics.mean(dp_losses), gaps))
    return out


def order(comparisons: list[Comparison], spec: TuneSpec) -> list[Comparison]:
    """Rows sorted by the cells' settings (numbers numerically), the `per` keys first."""

    def value(v: Any) -> tuple:
        return (0, v, "") if _number(v) else (1, 0, canonical(v))

    return sorted(comparisons, key=lambda c: [value(v) for v in c.cell.settings.values()])


# --- presentation ----------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("|", "\\|")


def _best_text(cell: TunedCell | None) -> str:
    if cell is None:
        return ""
    tuned = [k for k, values in cell.tried.items() if len(values) > 1]
    shown = tuned or [k for k, v in cell.best.items() if v is not None]
    return ", ".join(f"{k.split('.')[-1] if len(shown) == 1 else k}={_fmt(cell.best[k])}" for k in shown)


def gap_text(comparison: Comparison) -> str:
    """`+4.40% (+4.10..+4.70)`: the mean gap over paired seeds and its range (one seed: the gap alone)."""
    if not comparison.gaps:
        return ""
    mean = f"{comparison.gap:+.2f}%"
    if len(comparison.gaps) == 1:
        return mean
    return f"{mean} ({min(comparison.gaps):+.2f}..{max(comparison.gaps):+.2f})"


def markdown(comparisons: list[Comparison], spec: TuneSpec) -> list[str]:
    """The tuned table: a row per DiLoCo/MuLoCo cell, its best setting and loss, its DP's, and the gap."""
    if not comparisons:
        return ["No DiLoCo/MuLoCo run completed: nothing to compare."]
    keys = list(comparisons[0].cell.settings)
    header = [
        *(f"`{k}`" for k in keys),
        "best",
        "final val loss",
        "DP best",
        "DP final val loss",
        "gap to DP",
        "seeds",
        "notes",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in comparisons:
        notes = [*c.cell.warnings, *(f"DP: {w}" for w in (c.dp.warnings if c.dp else []))]
        if c.dp is None:
            notes.append("no DP run with these settings")
        elif c.dp.settings.get("workers") != c.cell.settings.get("workers", c.dp.settings.get("workers")):
            notes.append(f"DP at workers={c.dp.settings.get('workers')}")
        if c.dp is not None and not c.seeds:
            notes.append("no seed shared with DP: no gap")
        cells = [
            *(_fmt(c.cell.settings.get(k)) for k in keys),
            _best_text(c.cell),
            "" if c.loss is None else f"{c.loss:.4f}",
            _best_text(c.dp),
            "" if c.dp_loss is None else f"{c.dp_loss:.4f}",
            gap_text(c),
            str(len(c.seeds) or len(c.cell.by_seed)),
            "; ".join(notes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def as_json(comparisons: list[Comparison], spec: TuneSpec) -> dict[str, Any]:
    def cell(c: TunedCell | None) -> dict[str, Any] | None:
        if c is None:
            return None
        return {
            "settings": c.settings,
            "best": c.best,
            "tried": c.tried,
            "chosen_on_seeds": c.chosen_on,
            "runs": {_fmt(s): r.name for s, r in c.by_seed.items()},
            "warnings": c.warnings,
        }

    return {
        "tune": spec.as_dict(),
        "rows": [
            {
                "cell": cell(c.cell),
                "dp": cell(c.dp),
                "seeds": c.seeds,
                "final_val_loss": c.loss,
                "dp_final_val_loss": c.dp_loss,
                "pct_over_dp_per_seed": c.gaps,
                "pct_over_dp": c.gap,
            }
            for c in comparisons
        ],
    }


def gap_series(
    comparisons: list[Comparison],
) -> dict[str, list[tuple[float, float, float, float]]]:
    """label -> [(K, mean gap, lowest, highest)] for the gap-vs-K plot: one line per combination of the
    cell's settings other than `workers` (its lines need 2+ values of K)."""
    series: dict[str, list[tuple[float, float, float, float]]] = {}
    for c in comparisons:
        k = c.cell.settings.get("workers")
        if not c.gaps or not isinstance(k, int):
            continue
        label = " ".join(_fmt(v) for key, v in c.cell.settings.items() if key != "workers") or "DiLoCo"
        series.setdefault(label, []).append((k, c.gap, min(c.gaps), max(c.gaps)))
    return {label: points for label, points in series.items() if len({p[0] for p in points}) > 1}
