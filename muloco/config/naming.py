"""Short, readable, filesystem-safe name parts for runs that differ by a few config values: a sweep's runs
(sweep/expand.py) and a run whose command-line overrides change its config (`load_config` names it
`<run.name>_<parts>`, so such a run never lands in the directory of a run of another config)."""

from __future__ import annotations

import re
from typing import Any


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


def short_labels(keys: list[str]) -> dict[str, str]:
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
    if key == "dp.comm_hook":
        return "ddp" if value == "none" else f"ddp-{format_value(value)}"
    if key == "dp.powersgd_rank":  # left out of runs without PowerSGD
        return f"r{format_value(value)}" if assignment.get("dp.comm_hook", "powersgd") == "powersgd" else ""
    return f"{format_value(label)}-{format_value(value)}"
