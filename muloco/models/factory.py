"""`model.factory: "package.module:function"`: the user's own model, built by their function.

The function gets `model.kwargs`, plus `vocab_size` (the data's) and `seq_len` (model.seq_len) when its
signature takes them and the config does not set them. Every way this can go wrong is a one-line
ConfigError naming model.factory or model.kwargs.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from torch import nn

from muloco.errors import ConfigError, one_line


def _import(module_name: str):
    # The current directory first, as `python -m` would have it: `muloco train` is a console script,
    # whose sys.path starts at its own bin/ directory.
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the user's module raises at import time
        raise ConfigError(
            f"model.factory: cannot import {module_name!r} ({one_line(exc)}); it must be "
            "importable from the current directory or PYTHONPATH"
        ) from None
    finally:
        if added:
            sys.path.remove(os.getcwd())


def factory_kwargs(fn, kwargs: dict[str, Any], vocab_size: int, seq_len: int) -> dict[str, Any]:
    """`kwargs` with vocab_size and seq_len filled in where `fn` takes them and they are not set."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: pass kwargs as they are
        return dict(kwargs)
    filled = dict(kwargs)
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len)):
        if name in parameters and name not in filled:
            filled[name] = value
    return filled


def build_from_factory(spec: str, kwargs: dict[str, Any], vocab_size: int, seq_len: int) -> nn.Module:
    """The nn.Module that `package.module:function(**kwargs)` returns."""
    module_name, _, attr = spec.partition(":")
    module = _import(module_name)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"model.factory: module {module_name!r} has no attribute {attr!r}; check the name")
    if not callable(fn):
        raise ConfigError(f"model.factory: {spec} is a {type(fn).__name__}, not a function or class")
    try:
        model = fn(**factory_kwargs(fn, kwargs, vocab_size, seq_len))
    except Exception as exc:  # the user's code: one line, no traceback
        raise ConfigError(
            f"model.factory: {spec}(**model.kwargs) raised {one_line(exc)}; "
            "check model.kwargs against the function's arguments"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: {spec} returned a {type(model).__name__}, not a torch nn.Module")
    return model
