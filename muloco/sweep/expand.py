"""From a sweep's grid to its runs, pure functions: grid + zip + exclude -> assignments (`expand_grid`), the
DP baseline of a run (`dp_baseline_assignment`), and short, unique run names (`run_names`)."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

from muloco.config.naming import name_part, short_labels
from muloco.sweep.spec import _canonical

# A DP run ignores these sections, so its baseline drops them (and sets compression.scheme=none, which
# config validation requires of method: dp); the baseline sends uncompressed gradients (no dp.comm_hook).
DP_IGNORED_PREFIXES = ("sync.", "outer.", "compression.", "dp.")


def expand_grid(
    grid: dict[str, list[Any]],
    zip_groups: list[list[str]] = (),
    exclude: list[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The grid's assignments (key -> value), in a fixed order: the product over axes, the first grid key
    outermost. A zip group is one axis whose keys advance together; a run matching every key of an
    exclude rule is dropped. An empty grid is one run with no assignment."""
    group_of = {key: tuple(g) for g in zip_groups for key in g}
    axes: list[tuple[str, ...]] = []
    for key in grid:
        axis = group_of.get(key, (key,))
        if axis not in axes:
            axes.append(axis)
    options = [
        [dict(zip(axis, values, strict=True)) for values in zip(*(grid[k] for k in axis), strict=True)]
        for axis in axes
    ]
    runs = []
    for combo in itertools.product(*options):
        assignment = {key: value for part in combo for key, value in part.items()}
        assignment = {key: assignment[key] for key in grid}  # grid order, whatever the zip order
        if not any(_matches(assignment, rule) for rule in exclude):
            runs.append(assignment)
    return runs


def _matches(assignment: dict[str, Any], rule: dict[str, Any]) -> bool:
    return all(key in assignment and _canonical(assignment[key]) == _canonical(v) for key, v in rule.items())


def dp_baseline_assignment(assignment: dict[str, Any]) -> dict[str, Any]:
    """The grid values of a run's DP baseline: the same values (inner optimizer, workers, budget, ...)
    without the keys a DP run ignores (sync, outer, compression) and the dp.comm_hook ones, with method=dp."""
    kept = {k: v for k, v in assignment.items() if not k.startswith(DP_IGNORED_PREFIXES) and k != "method"}
    return {"method": "dp", **kept}


# --- run names (pure) -------------------------------------------------------------------------------


def run_names(assignments: list[dict[str, Any]], prefixes: list[str] | None = None) -> list[str]:
    """Short, readable, filesystem-safe names, unique and deterministic: the parts of the keys that vary
    across the runs, joined by '_' (e.g. `muon_w4`). Names that still collide get a short hash suffix."""
    prefixes = prefixes or [""] * len(assignments)
    keys = list(dict.fromkeys(k for a in assignments for k in a))
    varied = [k for k in keys if len({_canonical(a.get(k)) for a in assignments}) > 1]
    labels = short_labels(varied)
    names = []
    for assignment, prefix in zip(assignments, prefixes, strict=True):
        parts = [prefix] if prefix else []
        for key in varied:
            if key in assignment and not (prefix and key == "method"):
                parts.append(name_part(key, assignment[key], assignment, labels[key]))
        name = "_".join(p for p in parts if p) or "run"
        names.append(name[:80])
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    for i, (name, assignment) in enumerate(zip(names, assignments, strict=True)):
        if counts[name] > 1:
            digest = hashlib.sha256(_canonical([prefixes[i], assignment]).encode()).hexdigest()[:6]
            names[i] = f"{name}_{digest}"
    assert len(set(names)) == len(names), f"{names=}"
    return names
