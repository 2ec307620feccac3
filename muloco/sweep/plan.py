"""Planning: every run of a sweep named and its config validated before anything runs (a typo fails the
sweep up front). `plan_sweep` -> `PlannedRun`s, each with the KEY=VALUE overrides (`override_text`) that make
`muloco train BASE ...` build exactly the planned config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from muloco.config import Config, apply_overrides, deep_merge, load_config, load_raw, validate
from muloco.errors import ConfigError
from muloco.optim.check import check_inner_optimizer
from muloco.sweep.expand import dp_baseline_assignment, expand_grid, run_names
from muloco.sweep.spec import SweepSpec, _canonical, _flatten

BASELINE_PREFIX = "dp-baseline"


@dataclass
class PlannedRun:
    """One run of a sweep: its directory name, the grid values that made it, and the full override list."""

    name: str
    assignment: dict[str, Any]
    overrides: list[str]
    config: Config
    baseline: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run.output_dir).expanduser() / self.config.run.name


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"train.total_tokens": 1} -> {"train": {"total_tokens": 1}}: the shape of a config file."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: '{part}' is a value, not a section; check the key")
        node[leaf] = value
    return nested


def _read_back(override: str) -> Any:
    """The value `muloco train` takes from one KEY=VALUE override (muloco.config's own parsing rules)."""
    node: Any = apply_overrides({}, [override])
    for part in override.split("=", 1)[0].strip().split("."):
        node = node[part]
    return node


def override_text(key: str, value: Any) -> str | None:
    """KEY=VALUE text that `muloco train` reads back as exactly this value (a resolved config value), or
    None if there is none (e.g. None for a text field)."""
    candidates = [f"{key}={value}"] if isinstance(value, str) else []
    candidates.append(f"{key}={json.dumps(value)}")  # JSON is YAML: numbers, bools, null, lists, "quoted"
    for text in candidates:
        try:
            if _canonical(_read_back(text)) == _canonical(value):
                return text
        except ConfigError:
            continue
    return None


def _dp_identity(cfg: Config) -> str:
    """What makes two DP runs the same run: the seed and every section but where they run and the ones
    DP ignores."""
    data = cfg.to_dict()
    for section in (
        "logging",
        "checkpoint",
        "backend",
        "simulation",
        "device",
        "sync",
        "outer",
        "compression",
    ):
        data.pop(section, None)
    data["run"] = {"seed": cfg.run.seed}
    data["train"].pop("threads", None)
    return _canonical(data)


class _Resolver:
    """Resolves a run's settings the way a config file would read them (the base config, deep-merged with
    the sweep's YAML values), then finds the KEY=VALUE overrides that make `muloco train BASE ...` build
    the very same config."""

    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self.base = load_raw(spec.base)

    def config(self, values: dict[str, Any], what: str) -> Config:
        try:
            cfg = validate(deep_merge(self.base, _nest(values)), source=str(self.spec.base))
            return check_inner_optimizer(cfg, source=str(self.spec.base))
        except ConfigError as exc:
            raise ConfigError(f"sweep {self.spec.path}: run {what}: {exc}") from None

    def overrides(self, cfg: Config, keys: list[str], what: str) -> list[str]:
        resolved = _flatten(cfg.to_dict())
        texts = {key: override_text(key, resolved[key]) for key in keys if key in resolved}
        overrides = [text for text in texts.values() if text is not None]
        try:
            same = load_config(self.spec.base, overrides).to_dict() == cfg.to_dict()
        except ConfigError:
            same = False
        if not same:
            bad = [key for key, text in texts.items() if text is None] or keys
            raise ConfigError(
                f"sweep {self.spec.path}: run {what}: {bad[0]}={resolved.get(bad[0])!r} cannot be passed to "
                "`muloco train` as KEY=VALUE; set it in the base config instead"
            )
        return overrides


def _describe(assignment: dict[str, Any]) -> str:
    return " ".join(f"{k}={_canonical(v) if not isinstance(v, str) else v}" for k, v in assignment.items())


def plan_sweep(spec: SweepSpec, threads: int | None) -> list[PlannedRun]:
    """Every run of the sweep, names assigned and configs validated (ConfigError names the bad run).

    threads: train.threads of each run (the CPU cores divided among the parallel jobs), unless the sweep
    sets train.threads itself."""
    assignments = expand_grid(spec.grid, spec.zip_groups, spec.exclude)
    if not assignments:
        raise ConfigError(f"sweep file {spec.path}: exclude drops every run of the grid; loosen the rules")
    resolver = _Resolver(spec)
    grid_configs = [resolver.config({**spec.fixed, **a}, _describe(a) or "(base)") for a in assignments]

    entries: list[tuple[dict[str, Any], bool]] = [(a, False) for a in assignments]
    if spec.baselines:
        seen = {_dp_identity(cfg) for cfg in grid_configs if cfg.method == "dp"}
        for assignment, cfg in zip(assignments, grid_configs, strict=True):
            if cfg.method != "diloco":
                continue
            dp = dp_baseline_assignment(assignment)
            values = {**spec.fixed, "compression.scheme": "none", **dp}
            identity = _dp_identity(resolver.config(values, f"{_describe(dp)} (DP baseline)"))
            if identity not in seen:
                seen.add(identity)
                entries.append((dp, True))

    names = run_names(
        [a for a, _ in entries], [BASELINE_PREFIX if is_baseline else "" for _, is_baseline in entries]
    )
    runs = []
    for (assignment, is_baseline), name in zip(entries, names, strict=True):
        values = {**spec.fixed, **({"compression.scheme": "none"} if is_baseline else {}), **assignment}
        values["run.name"] = name
        values["run.output_dir"] = str(spec.output_dir)
        if "train.threads" not in values and threads is not None:
            # Not part of the config fingerprint: an unfinished run resumes with whatever --jobs gives it.
            values["train.threads"] = threads
        values.setdefault("logging.wandb_group", spec.name)
        cfg = resolver.config(values, name)
        if cfg.dp.comm_hook != "none" and values.get("train.threads") == threads:
            # Started as one process per worker (runner.start_process): the job's cores shared among them.
            values["train.threads"] = max(1, threads // cfg.workers)
            cfg = resolver.config(values, name)
        overrides = resolver.overrides(cfg, list(values), name)
        runs.append(PlannedRun(name, assignment, overrides, cfg, is_baseline))
    return runs
