"""The run directories a report reads, as records: `load_runs(DIR)` reads every `DIR/*/summary.json` with
its `config.yaml` (flattened to dotted keys, only the settings that act on the run) and its eval curve from
`metrics.jsonl`; `find_baseline` gives a run its DP baseline (below), `varied_keys` the settings that tell
the runs apart. The report (report.py) and the tuned comparison (tuning.py) both work on these records.

A run's DP baseline is the completed `method: dp` run with the same inner optimizer, tokens seen and
settings DP uses (model, data, inner, train budget); one with the same `workers` (the same data shards) is
preferred. Without one, it is the best (lowest final loss) DP run that differs from it only in its lrs
(`inner.lr`, `inner.adamw.lr`): the tuned baseline, so each method can run at its own tuned lr.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from muloco.run.metrics import read_jsonl

# Config keys that never tell runs apart in a report (names, places, logging, threads).
IGNORED_PREFIXES = ("run.name", "run.output_dir", "logging.", "checkpoint.", "train.threads")
# Keys a DP run ignores: a DiLoCo run's DP baseline is matched on every other setting.
DP_IGNORED_PREFIXES = ("sync.", "outer.", "compression.", "diagnostics.")
# What a method may differ in from its DP baseline beside them: the baseline has no communication hook, and
# may run on another backend (where it ran, not its maths: e.g. DDP + PowerSGD over torch, DP simulated).
DP_BASELINE_FREE_PREFIXES = (*DP_IGNORED_PREFIXES, "dp.", "backend.")
# Keys a DP run ignores, or that may differ between a run and its DP baseline.
DP_FREE_PREFIXES = ("method", "workers", *DP_BASELINE_FREE_PREFIXES)
# The inner lrs: a run without a DP run at its own lr is compared with the best DP run over these.
LR_KEYS = ("inner.lr", "inner.adamw.lr")


@dataclass
class RunRecord:
    """One run directory: its summary.json, its config.yaml flattened to dotted keys, its eval curve."""

    name: str
    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    evals: list[tuple[int, float]] = field(default_factory=list)  # (tokens, val_loss)
    baseline: RunRecord | None = None
    pct_over_dp: float | None = None

    @property
    def group(self) -> str:
        return str(self.summary.get("inner_optimizer") or self.config.get("inner.optimizer") or "?")

    @property
    def is_dp_method(self) -> bool:
        """method: dp, with or without a DDP communication hook."""
        return (self.summary.get("method") or self.config.get("method")) == "dp"

    @property
    def is_dp(self) -> bool:
        """The DP baseline: method dp with uncompressed gradients. A dp.comm_hook run (bf16, PowerSGD) is
        a method compared against it, like DiLoCo."""
        return self.is_dp_method and self.config.get("dp.comm_hook", "none") == "none"

    @property
    def loss(self) -> float | None:
        value = self.summary.get("final_val_loss")
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    @property
    def completed(self) -> bool:
        return self.summary.get("status") == "completed"


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def acting_settings(flat: dict[str, Any]) -> dict[str, Any]:
    """A run's flattened config without the keys that do not act on it, so that runs written before such
    a key existed compare equal to runs that carry its default: train.decay_fraction acts only with
    lr_schedule wsd, dp.* only with a comm hook (dp.powersgd_* only with powersgd)."""
    hook = flat.get("dp.comm_hook", "none")
    return {
        key: value
        for key, value in flat.items()
        if not (key == "train.decay_fraction" and flat.get("train.lr_schedule") != "wsd")
        and not (key.startswith("dp.") and hook == "none")
        and not (key.startswith("dp.powersgd_") and hook != "powersgd")
    }


def canonical(value: Any) -> str:
    """A value as comparable text (JSON with sorted keys)."""
    return json.dumps(value, sort_keys=True, default=str)


def load_runs(directory: Path) -> list[RunRecord]:
    """Every `directory/*/summary.json`, sorted by directory name; an unreadable one is skipped."""
    runs = []
    for summary_path in sorted(directory.glob("*/summary.json")):
        run_dir = summary_path.parent
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(summary, dict):
            continue
        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            config = None
        evals: dict[int, float] = {}
        for record in read_jsonl(run_dir / "metrics.jsonl"):
            if record.get("kind") == "eval" and isinstance(record.get("val_loss"), int | float):
                evals[int(record.get("tokens", 0))] = float(record["val_loss"])
        runs.append(
            RunRecord(
                run_dir.name,
                run_dir,
                summary,
                acting_settings(_flatten(config)) if isinstance(config, dict) else {},
                sorted(evals.items()),
            )
        )
    return runs


def varied_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose values differ across the runs, in config order (names and places left out)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.config))
    return [
        key
        for key in keys
        if not key.startswith(IGNORED_PREFIXES)
        and len({canonical(run.config.get(key)) for run in runs if run.config}) > 1
    ]


def pct_over(loss: float, dp_loss: float) -> float:
    """How much worse than DP, in percent: (loss / dp_loss - 1) x 100 (the MuLoCo paper's measure)."""
    return (loss / dp_loss - 1.0) * 100.0


def find_baseline(run: RunRecord, runs: list[RunRecord]) -> RunRecord | None:
    """The run's DP baseline (module docstring), or None."""
    if run.is_dp:
        return None

    def dp_settings(r: RunRecord, free: tuple[str, ...] = ()) -> dict[str, Any]:
        return {
            k: canonical(v)
            for k, v in r.config.items()
            if not k.startswith(IGNORED_PREFIXES) and not k.startswith((*DP_FREE_PREFIXES, *free))
        }

    def matching(free: tuple[str, ...]) -> list[RunRecord]:
        return [
            r
            for r in runs
            if r.is_dp
            and r.completed
            and r.loss is not None
            and r.group == run.group
            and r.summary.get("tokens_seen") == run.summary.get("tokens_seen")
            and (not r.config or not run.config or dp_settings(r, free) == dp_settings(run, free))
        ]

    candidates = matching(())
    if not candidates:  # the tuned DP baseline: the best DP run that differs only in its lrs
        candidates = sorted(matching(LR_KEYS), key=lambda r: r.loss)
    same_workers = [r for r in candidates if r.summary.get("workers") == run.summary.get("workers")]
    return (same_workers or candidates or [None])[0]


def own_lr(run: RunRecord) -> Any:
    """The lr of the run's inner optimizer: inner.adamw.lr for AdamW, inner.lr for every other (under
    Muon, inner.adamw.lr only drives the embeddings, head and norms)."""
    return run.config.get("inner.adamw.lr" if run.group == "adamw" else "inner.lr")


def value_text(value: Any) -> str:
    """A config value as the report writes it, in tables and plot labels: booleans in lower case, floats
    short, a '|' escaped for Markdown."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|")
