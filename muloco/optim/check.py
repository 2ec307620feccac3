"""The inner optimizer a config names, checked before anything is built or written.

The schema (muloco/config/) types the `inner:` fields and knows nothing of optimizers; whether
`inner.optimizer` names one that the inner loop can drive, and whether the other inner fields suit it, is
said here, where a config is loaded for a run: `load_run_config` loads and checks (`muloco.load_config`;
the CLI's train, launch, config and plan commands), and a sweep's plan checks each run's config. A failure
is the schema's kind of error: one line naming the field (and the override that set it), exit code 2 from
the CLI.

A built-in name (muon, adamw, sgd, torch_muon) is checked without importing torch (`muloco launch` and
`muloco config` stay light); any other is resolved through the catalogue (catalogue.py, which imports torch
then), its inner.kwargs checked against the constructor and one trial step taken on stand-ins for the
parameters the route gives it.
"""

from __future__ import annotations

from pathlib import Path

from muloco.config import Config, InnerConfig, field_error, load_config
from muloco.optim.catalogue import BUILT_IN_OPTIMIZERS, check_kwargs, optimizer_class, trial_step


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a run accepts, as `muloco config` prints it: YAML (with `extends:`) and dotted
    `KEY=VALUE` overrides validated by the schema (muloco.config.load_config), then the inner optimizer it
    names checked. Anything wrong is a one-line ConfigError."""
    source = str(path) if path is not None else "config"
    return check_inner_optimizer(load_config(path, overrides), source, overrides)


def check_inner_optimizer(
    cfg: Config, source: str = "config", overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """`cfg` itself when its inner optimizer can run; else a one-line ConfigError naming the field, blaming
    the override in `overrides` that set it, if one did, else `source` (the config file)."""
    inner = cfg.inner
    if inner.optimizer in BUILT_IN_OPTIMIZERS:
        problem = built_in_problem(inner)
        if problem is not None:
            raise field_error("inner", problem, source, overrides)
        return cfg
    try:
        cls = optimizer_class(inner.optimizer)
    except ValueError as exc:
        raise field_error("inner.optimizer", str(exc), source, overrides) from None
    route = "matrices" if inner.route == "matrices" else "all"
    try:
        check_kwargs(inner.optimizer, cls, inner.kwargs)
        trial_step(inner.optimizer, cls, inner.lr, inner.kwargs, route)
    except ValueError as exc:
        raise field_error("inner", str(exc), source, overrides) from None
    return cfg


def built_in_problem(inner: InnerConfig) -> str | None:
    """What a built-in inner.optimizer cannot take from the other inner fields, or None."""
    if inner.kwargs:
        return (
            f"inner.kwargs is for optimizers that are not built in; inner.optimizer={inner.optimizer} "
            "takes the inner.* fields (inner.lr, inner.momentum, inner.adamw.*, ...)"
        )
    if inner.route == "all" and inner.optimizer in ("muon", "torch_muon"):
        return (
            f"inner.route=all puts every parameter on {inner.optimizer}, which takes only matrices; "
            "use inner.route=matrices (or auto)"
        )
    if inner.route == "matrices" and inner.optimizer == "adamw":
        return (
            "inner.route=matrices with inner.optimizer=adamw is AdamW on every parameter; use "
            "inner.route=all (or auto)"
        )
    return None
