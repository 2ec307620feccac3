"""From a sweep's grid to its runs, pure functions: grid + zip + exclude -> assignments (`expand_grid`), the
DP baseline of a run (`dp_baseline_assignment`), and short, unique run names (`run_names`)."""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import Any

from muloco.sweep.spec import _canonical

# A DP run ignores these sections, so its baseline drops them (and sets compression.scheme=none, which
# config validation requires of method: dp).
DP_IGNORED_PREFIXES = ("sync.", "outer.", "compression.")


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
    without the keys a DP run ignores (sync, outer, compression), with method=dp."""
    kept = {k: v for k, v in assignment.items() if not k.startswith(DP_IGNORED_PREFIXES) and k != "method"}
    return {"method": "dp", **kept}


# --- run names (pure) -------------------------------------------------------------------------------


def format_value(value: Any) -> str:
    """A value as a short, filesystem-safe name part."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, list | tuple):
        text = "-".join(format_value(v) for v in value)
    else:
        text = str(value)
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.") or "x"


def _short_labels(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix of each key that is unique among keys: inner.lr -> lr, unless outer.lr
    also varies (then inner.lr / outer.lr)."""
    labels = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            label = ".".join(parts[-n:])
            if sum(1 for other in keys if other == label or other.endswith("." + label)) == 1:
                break
        labels[key] = label
    return labels


def name_part(key: str, value: Any, assignment: dict[str, Any], label: str) -> str:
    """One key's part of a run name: readable for the keys sweeps vary most, `label-value` otherwise.
    Compression bits / error feedback are left out of runs they do not apply to (fp32 runs)."""
    scheme = assignment.get("compression.scheme")
    if key in ("inner.optimizer", "method", "model.preset", "data.source"):
        return format_value(value)
    if key == "compression.scheme":
        return "fp32" if value == "none" else format_value(value)
    if key == "workers":
        return f"w{format_value(value)}"
    if key == "sync.every":
        return f"H{format_value(value)}"
    if key == "run.seed":
        return f"seed{format_value(value)}"
    if key == "compression.bits":
        return "" if scheme not in (None, "linear", "statistical") else f"{format_value(value)}bit"
    if key == "compression.error_feedback":
        return "" if scheme == "none" else ("ef" if value else "noef")
    return f"{format_value(label)}-{format_value(value)}"


def run_names(assignments: list[dict[str, Any]], prefixes: list[str] | None = None) -> list[str]:
    """Short, readable, filesystem-safe names, unique and deterministic: the parts of the keys that vary
    across the runs, joined by '_' (e.g. `muon_w4`). Names that still collide get a short hash suffix."""
    prefixes = prefixes or [""] * len(assignments)
    keys = list(dict.fromkeys(k for a in assignments for k in a))
    varied = [k for k in keys if len({_canonical(a.get(k)) for a in assignments}) > 1]
    labels = _short_labels(varied)
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
