"""Sweeps: a grid of `muloco train` runs from one YAML file, resumable, with DP baselines and a report.

A sweep file (docs/sweeps.md)::

    name: inner_optimizers              # default: the file's stem
    base: ../quickstart.yaml            # the base config, relative to this file
    output_dir: runs/sweeps/inner_optimizers   # default: runs/sweeps/<name>, relative to the working dir
    fixed: {logging.progress: lines}    # overrides applied to every run
    grid:                               # dotted key -> list of values; the runs are the product
      inner.optimizer: [adamw, muon]
      workers: [1, 2, 4, 8]
    zip: [[compression.bits, compression.error_feedback]]  # keys whose lists advance together
    exclude: [{inner.optimizer: adamw, workers: 8}]       # drop runs that match every key of a rule
    baselines: auto                     # add the DP run of each DiLoCo/MuLoCo run (deduplicated)

The pieces are pure functions, testable alone: `parse_sweep` (file -> `SweepSpec`, every malformation a
`ConfigError`), `expand_grid` (grid + zip + exclude -> assignments), `dp_baseline_assignment`, `run_names`,
`override_text`; `plan_sweep` validates every run's config up front (a typo fails the sweep before anything
runs) and `run_sweep` runs the plan, J subprocesses at a time, skipping runs whose summary.json says
`completed`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from muloco.config import (
    Config,
    _did_you_mean,
    apply_overrides,
    deep_merge,
    load_config,
    load_raw,
    read_yaml,
    validate,
)
from muloco.errors import ConfigError, UserError

log = logging.getLogger("muloco")

TOP_LEVEL_KEYS = ("name", "base", "output_dir", "fixed", "grid", "zip", "exclude", "baselines")
# A DP run ignores these sections, so its baseline drops them (and sets compression.scheme=none, which
# config validation requires of method: dp).
DP_IGNORED_PREFIXES = ("sync.", "outer.", "compression.")
# Keys the sweep sets on every run itself.
RESERVED_KEYS = ("run.name", "run.output_dir")
BASELINE_PREFIX = "dp-baseline"
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


# --- the sweep file ---------------------------------------------------------------------------------


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"total_tokens": 1}} -> {"train.total_tokens": 1}; dotted keys pass through."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
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
    )


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


# --- expansion (pure) -------------------------------------------------------------------------------


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


# --- planning: validate every run up front ----------------------------------------------------------


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


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_status(run_dir: Path) -> str:
    """completed | failed | interrupted (from summary.json), or `new` when there is none yet."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("status", "failed"))
    except FileNotFoundError:
        return "new"
    except (OSError, json.JSONDecodeError, AttributeError):
        return "failed"


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
            return validate(deep_merge(self.base, _nest(values)), source=str(self.spec.base))
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
        overrides = resolver.overrides(cfg, list(values), name)
        runs.append(PlannedRun(name, assignment, overrides, cfg, is_baseline))
    return runs


# --- running ----------------------------------------------------------------------------------------


def train_command(spec: SweepSpec, run: PlannedRun) -> list[str]:
    return [sys.executable, "-m", "muloco", "train", str(spec.base), *run.overrides]


def start_process(spec: SweepSpec, run: PlannedRun, log_path: Path) -> subprocess.Popen:
    """Start `muloco train` for one run, stdout and stderr appended to log_path. It gets its own session,
    so a Ctrl+C reaches it once, forwarded by the sweep (a second SIGINT would make it skip its final
    checkpoint)."""
    env = dict(os.environ)
    threads = run.config.train.threads
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log_path, "a", encoding="utf-8") as log_file:
        log_file.write(f"=== muloco sweep {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(run.overrides)}\n")
        log_file.flush()
        return subprocess.Popen(
            train_command(spec, run),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


@dataclass
class SweepResult:
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # run name -> why


Launcher = Callable[[SweepSpec, PlannedRun, Path], Any]  # returns a Popen-like: poll(), wait(), send_signal()


def run_sweep(
    spec: SweepSpec, runs: list[PlannedRun], jobs: int, launch: Launcher | None = None, poll_s: float = 0.5
) -> SweepResult:
    """Run every run not yet completed, `jobs` at a time. A failed run does not stop the others."""
    launch = launch or start_process
    result = SweepResult()
    pending = []
    for run in runs:
        if run_status(run.run_dir) == "completed":
            result.skipped.append(run.name)
            changed = _changed_key(run)
            if changed:
                log.warning(
                    "run=%s completed with a different %s than the sweep now asks for; it is kept as it is "
                    "(delete %s to run it again)",
                    run.name,
                    changed,
                    run.run_dir,
                )
        else:
            pending.append(run)
    log.info(
        "sweep=%s runs=%d completed_before=%d to_run=%d jobs=%d dir=%s",
        spec.name,
        len(runs),
        len(result.skipped),
        len(pending),
        jobs,
        spec.output_dir,
    )
    active: dict[str, tuple[PlannedRun, Any, float]] = {}
    total, started = len(pending), 0
    previous_term = _sigterm_as_interrupt()
    try:
        while pending or active:
            while pending and len(active) < jobs:
                run = pending.pop(0)
                run.run_dir.mkdir(parents=True, exist_ok=True)
                started += 1
                log.info("start run=%s (%d/%d) log=%s", run.name, started, total, run.run_dir / "train.log")
                active[run.name] = (run, launch(spec, run, run.run_dir / "train.log"), time.perf_counter())
            for name, (run, proc, t0) in list(active.items()):
                code = proc.poll()
                if code is not None:
                    del active[name]
                    _finish(run, code, time.perf_counter() - t0, result)
            if active:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        # Each child checkpoints at the end of its round and exits; wait for them so no run is left torn.
        log.info("sweep interrupted: stopping %d running run(s) after their current round", len(active))
        for _, proc, _ in active.values():
            proc.send_signal(signal.SIGINT)
        for _, proc, _ in active.values():
            try:
                proc.wait()
            except KeyboardInterrupt:  # a second Ctrl+C: leave at once (they keep their last checkpoint)
                for _, other, _ in active.values():
                    other.send_signal(signal.SIGINT)
                break
        raise
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    return result


def _sigterm_as_interrupt():
    """SIGTERM stops the sweep like Ctrl+C: the runs live in their own sessions, so without this a killed
    sweep would leave them training (and a rerun would start a second process on the same run dir)."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave SIGTERM alone
        return None


def _changed_key(run: PlannedRun) -> str | None:
    """The first setting (dotted key) in which a finished run's config.yaml differs from the plan."""
    try:
        done = yaml.safe_load((run.run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(done, dict):
        return None
    ignore = ("run.name", "run.output_dir", "logging.", "checkpoint.", "train.threads")
    old, new = _flatten(done), _flatten(run.config.to_dict())
    for key in sorted(set(old) | set(new)):
        if not key.startswith(ignore) and _canonical(old.get(key)) != _canonical(new.get(key)):
            return key
    return None


def _finish(run: PlannedRun, code: int, seconds: float, result: SweepResult) -> None:
    status = run_status(run.run_dir)
    result.ran.append(run.name)
    if code == 0 and status == "completed":
        summary = json.loads((run.run_dir / "summary.json").read_text(encoding="utf-8"))
        log.info(
            "end run=%s status=completed final_val_loss=%s wall_s=%.0f",
            run.name,
            summary.get("final_val_loss"),
            seconds,
        )
        return
    why = f"exit code {code}, status {status}; see {run.run_dir / 'train.log'}"
    result.failed[run.name] = why
    log.info("end run=%s status=failed (%s)", run.name, why)


def describe_plan(spec: SweepSpec, runs: list[PlannedRun]) -> str:
    """The --dry-run listing: one line per run with its status and varied overrides, then the shared ones."""
    lines = [
        f"sweep {spec.name}: {len(runs)} runs ({sum(r.baseline for r in runs)} DP baselines) in "
        f"{spec.output_dir}, base {spec.base}",
    ]
    shared = [o for o in runs[0].overrides if all(o in r.overrides for r in runs)]
    width = max(len(r.name) for r in runs)
    for run in runs:
        own = [o for o in run.overrides if o not in shared and not o.startswith("run.name=")]
        lines.append(f"  {run.name:<{width}}  {run_status(run.run_dir):<11}  {' '.join(own)}")
    lines.append(f"every run: muloco train {spec.base} {' '.join(shared)} run.name=<name>")
    return "\n".join(lines)


def sweep_main(path: str | Path, jobs: int = 1, dry_run: bool = False) -> int:
    """`muloco sweep`: plan (validating every run), run what is not completed, write the report."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {jobs}")
    spec = load_sweep(path)
    threads = max(1, cpu_count() // jobs)
    runs = plan_sweep(spec, threads)
    if dry_run:
        print(describe_plan(spec, runs))
        return 0
    result = run_sweep(spec, runs, jobs)

    from muloco.report import build_report  # matplotlib is slow to import: only when a report is due

    try:
        log.info("report=%s", build_report(spec.output_dir)["report.md"])
    except UserError as exc:  # e.g. no run got as far as a summary.json: say so, then list the failures
        log.info("no report: %s", exc)
    done = len(runs) - len(result.failed)
    if result.failed:
        names = ", ".join(f"{name} ({why})" for name, why in result.failed.items())
        log.info("sweep=%s completed=%d failed=%d: %s", spec.name, done, len(result.failed), names)
        return 1
    log.info("sweep=%s completed=%d/%d dir=%s", spec.name, done, len(runs), spec.output_dir)
    return 0
