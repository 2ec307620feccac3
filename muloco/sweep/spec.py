"""The sweep file: its schema (docs/sweeps.md), checked and resolved into a `SweepSpec`.

`parse_sweep` turns already-parsed YAML into a `SweepSpec`, every malformation a one-line `ConfigError`
that names the key and the fix; `load_sweep` reads the file first. `_flatten` and `_canonical` are the
dotted-key and value-identity helpers the rest of the package shares.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel

from muloco.config import Config, _did_you_mean, read_yaml
from muloco.errors import ConfigError
from muloco.tools.tuning import SEED_KEY, TuneSpec

TOP_LEVEL_KEYS = ("name", "base", "output_dir", "fixed", "grid", "zip", "exclude", "baselines", "tune")
# Keys the sweep sets on every run itself.
RESERVED_KEYS = ("run.name", "run.output_dir")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


@dataclass
class SweepSpec:
    """A parsed, checked sweep file. Keys are dotted config keys; values are already YAML-parsed."""

    name: str
    path: Path
    base: Path
    output_dir: Path
    grid: dict[str, list[Any]]
    zip_groups: list[list[str]] = field(default_factory=list)
    exclude: list[dict[str, Any]] = field(default_factory=list)
    fixed: dict[str, Any] = field(default_factory=dict)
    baselines: bool = False
    tune: TuneSpec | None = None


def _mapping_fields(model: type[BaseModel] = Config, prefix: str = "") -> frozenset[str]:
    """Dotted names of config fields whose value may itself be a mapping (model.hf, model.kwargs): one
    value each, never flattened into sub-keys."""
    found: set[str] = set()
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= _mapping_fields(annotation, f"{prefix}{name}.")
        elif dict in {get_origin(t) or t for t in (annotation, *get_args(annotation))}:
            found.add(f"{prefix}{name}")
    return frozenset(found)


MAPPING_VALUES = _mapping_fields()


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"total_tokens": 1}} -> {"train.total_tokens": 1}; dotted keys pass through."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in MAPPING_VALUES:
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _canonical(value: Any) -> str:
    """A hashable, order-stable text form of a YAML value (lists are unhashable)."""
    return json.dumps(value, sort_keys=True, default=str)


def parse_sweep(data: Any, path: str | Path) -> SweepSpec:
    """Check a sweep file's contents (already YAML-parsed) and resolve its paths. Raises ConfigError."""
    path = Path(path)
    where = f"sweep file {path}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a mapping with at least `base:` and `grid:`")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"{where}: unknown top-level key '{key}'; {_did_you_mean(str(key), list(TOP_LEVEL_KEYS))}"
            )

    name = data.get("name", path.stem)
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise ConfigError(f"{where}: name {name!r} must be a plain directory name (letters, digits, ._+-)")

    base = data.get("base")
    if base is None:
        raise ConfigError(
            f"{where}: missing `base:` (the config every run starts from, relative to the file)"
        )
    if not isinstance(base, str):
        raise ConfigError(f"{where}: base must be a path to a config file, got {base!r}")
    base_path = Path(os.path.normpath(path.parent / Path(base).expanduser()))
    if not base_path.is_file():
        raise ConfigError(f"{where}: base config not found: {base_path}; the path is relative to the file")

    output_dir = data.get("output_dir", f"runs/sweeps/{name}")
    if not isinstance(output_dir, str) or not output_dir:
        raise ConfigError(f"{where}: output_dir must be a directory path, got {output_dir!r}")

    grid_raw = data.get("grid") or {}
    if not isinstance(grid_raw, dict):
        raise ConfigError(f"{where}: grid must be a mapping of dotted keys to lists of values")
    grid: dict[str, list[Any]] = {}
    for key, values in grid_raw.items():
        if not isinstance(key, str) or isinstance(values, dict):
            raise ConfigError(
                f"{where}: grid key {key!r} must be a dotted key (e.g. inner.optimizer) with a list of values"
            )
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"{where}: grid.{key} must be a non-empty list of values, got {values!r}; "
                f"write e.g. {key}: [{values!r}]"
            )
        grid[key] = values

    fixed_raw = data.get("fixed") or {}
    if not isinstance(fixed_raw, dict):
        raise ConfigError(f"{where}: fixed must be a mapping of dotted keys to values")
    fixed = _flatten(fixed_raw)
    for key in (*grid, *fixed):
        if key in RESERVED_KEYS:
            raise ConfigError(
                f"{where}: {key} is set by the sweep (runs go to <output_dir>/<run name>); "
                "use the sweep's name/output_dir instead"
            )
    both = sorted(set(grid) & set(fixed))
    if both:
        raise ConfigError(f"{where}: {both[0]} is both in fixed and in grid; keep it in one of them")

    zip_groups = _parse_zip(data.get("zip") or [], grid, where)
    _check_no_repeats(grid, zip_groups, where)
    exclude = _parse_exclude(data.get("exclude") or [], grid, where)

    baselines = data.get("baselines", "none")
    if baselines not in ("auto", "none", False, None):
        raise ConfigError(
            f"{where}: baselines must be 'auto' (add DP baselines) or 'none', got {baselines!r}"
        )

    tune = _parse_tune(data.get("tune"), grid, where)

    return SweepSpec(
        name=name,
        path=path,
        base=base_path,
        output_dir=Path(output_dir).expanduser(),
        grid=grid,
        zip_groups=zip_groups,
        exclude=exclude,
        fixed=fixed,
        baselines=baselines == "auto",
        tune=tune,
    )


def _parse_tune(tune: Any, grid: dict[str, list[Any]], where: str) -> TuneSpec | None:
    """`tune: {over: [inner.lr], per: [inner.optimizer, workers]}`: grid keys only, the seed in neither
    (runs that differ only in run.seed are the repeats a best is averaged over)."""
    if tune is None:
        return None
    example = "e.g. tune: {over: [inner.lr], per: [inner.optimizer, workers]}"
    if not isinstance(tune, dict):
        raise ConfigError(f"{where}: tune must be a mapping with over: and per:, {example}")
    for key in tune:
        if key not in ("over", "per"):
            raise ConfigError(f"{where}: unknown key tune.{key}; {_did_you_mean(str(key), ['over', 'per'])}")
    lists = {}
    for part in ("over", "per"):
        keys = tune.get(part, [] if part == "per" else None)
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"{where}: tune.{part} must be a list of grid keys, {example}")
        for key in keys:
            if key == SEED_KEY:
                raise ConfigError(
                    f"{where}: tune.{part} lists {SEED_KEY}; seeds are what each best is averaged over, "
                    "leave them in grid only"
                )
            if key not in grid:
                raise ConfigError(
                    f"{where}: tune.{part} key {key!r} is not in grid; "
                    f"{_did_you_mean(key, list(grid)) if grid else 'add its list of values to grid'}"
                )
        lists[part] = keys
    if not lists["over"]:
        raise ConfigError(f"{where}: tune.over must name at least one grid key, {example}")
    both = sorted(set(lists["over"]) & set(lists["per"]))
    if both:
        raise ConfigError(f"{where}: tune: {both[0]} is both in over and in per; keep it in one of them")
    return TuneSpec(tuple(lists["over"]), tuple(lists["per"]))


def _parse_zip(groups: Any, grid: dict[str, list[Any]], where: str) -> list[list[str]]:
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ConfigError(f"{where}: zip must be a list of key lists, e.g. zip: [[sync.every, outer.lr]]")
    zipped: set[str] = set()
    for group in groups:
        if len(group) < 2:
            raise ConfigError(f"{where}: zip group {group} needs at least two grid keys")
        for key in group:
            if key not in grid:
                raise ConfigError(f"{where}: zip key {key!r} is not in grid; add its list of values to grid")
            if key in zipped:
                raise ConfigError(f"{where}: zip key {key!r} appears in two zip groups; keep it in one")
            zipped.add(key)
        lengths = {key: len(grid[key]) for key in group}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{k} has {n}" for k, n in lengths.items())
            raise ConfigError(f"{where}: zipped lists must have the same length ({detail}); fix the lists")
    return [list(g) for g in groups]


def _check_no_repeats(grid: dict[str, list[Any]], zip_groups: list[list[str]], where: str) -> None:
    """A grid key lists each value once; in a zip group a key may repeat a value (each method at its own
    lr: [adamw, adamw, muon] with [0.003, 0.006, 0.02]) but no two rows may be the same run."""
    zipped = {key for group in zip_groups for key in group}
    for key, values in grid.items():
        seen = [_canonical(v) for v in values]
        if key not in zipped and len(set(seen)) != len(seen):
            raise ConfigError(f"{where}: grid.{key} lists a value twice ({values!r}); list each value once")
    for group in zip_groups:
        rows = [tuple(_canonical(grid[k][i]) for k in group) for i in range(len(grid[group[0]]))]
        if len(set(rows)) != len(rows):
            raise ConfigError(
                f"{where}: zip group {group} lists the same row twice; list each combination once"
            )


def _parse_exclude(rules: Any, grid: dict[str, list[Any]], where: str) -> list[dict[str, Any]]:
    if not isinstance(rules, list):
        raise ConfigError(f"{where}: exclude must be a list of mappings, e.g. - {{workers: 8}}")
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or not rule:
            raise ConfigError(f"{where}: exclude[{i}] must be a non-empty mapping of grid keys to values")
        for key in rule:
            if key not in grid:
                raise ConfigError(
                    f"{where}: exclude[{i}] key {key!r} is not in grid; exclude rules match grid values"
                )
    return [dict(r) for r in rules]


def load_sweep(path: str | Path) -> SweepSpec:
    path = Path(path)
    data = read_yaml(path, what="sweep file")
    return parse_sweep(data, path)
