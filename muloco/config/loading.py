"""Loading a config: YAML file -> `extends:` chain merged -> dotted `KEY=VALUE` overrides -> validation.
Every failure becomes a one-line `ConfigError` naming the field (dotted path) and the fix."""

from __future__ import annotations

import copy
import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from muloco.config.naming import name_part
from muloco.config.schema import Config, fingerprinted
from muloco.errors import ConfigError

# --- loading ----------------------------------------------------------------------------------------


def read_yaml(path: Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file holding a mapping; any problem is a one-line ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}; check the path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"YAML syntax error in {what} {path}{where}: {problem}; fix the file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Return base updated by update, recursing into nested mappings (lists are replaced)."""
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_raw(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config and resolve its `extends:` chain (relative to the file) into one mapping."""
    path = Path(path).expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(str(p.name) for p in (*_chain, path))
        raise ConfigError(f"extends: cycle in config files ({cycle}); remove one of the extends keys")
    data = read_yaml(path)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"extends in {path} must be a file path or a list of paths")
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = (path.parent / parent).expanduser()
        if not parent_path.is_file():
            raise ConfigError(f"extends in {path}: file not found: {parent_path}; check the path")
        merged = deep_merge(merged, load_raw(parent_path, (*_chain, path)))
    return deep_merge(merged, data)


def _section_fields(dotted: list[str]) -> dict[str, Any] | None:
    """The fields of the section at a dotted path, or None if that path is not a section."""
    model: type[BaseModel] = Config
    for part in dotted:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model.model_fields


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(options)}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value), the value parsed as YAML (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like KEY=VALUE, e.g. train.total_tokens=100000")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key part; use dotted names like inner.lr=0.01")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as a plain string
    if isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" as a string; users mean a number
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        for depth, part in enumerate(parts):
            fields = _section_fields(parts[:depth])
            if fields is None:
                raise ConfigError(
                    f"override {text!r}: '{'.'.join(parts[:depth])}' is a value, not a section; "
                    f"drop '.{'.'.join(parts[depth:])}'"
                )
            if part not in fields:
                where = ".".join(parts[:depth]) or "the top level"
                raise ConfigError(
                    f"override {text!r}: unknown key '{part}' in {where}; {_did_you_mean(part, list(fields))}"
                )
        annotation = fields[parts[-1]].annotation
        if _is_text_field(annotation) and not (value is None and type(None) in typing.get_args(annotation)):
            value = text.split("=", 1)[1].strip()  # run.name=off stays "off", not YAML's False
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return data


def _is_text_field(annotation: Any) -> bool:
    """True for str, str | None and Literal[...] of strings: fields whose override is taken verbatim."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (list, tuple, dict):
        return False  # list[str] etc.: parsed as YAML ([a, b])
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    return bool(args) and all(a is str for a in args)


def _format_validation_error(exc: ValidationError, source: str) -> str:
    """The first error, as one line naming the dotted field and the fix."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
    field = ".".join(loc)
    if err["type"] == "extra_forbidden":
        options = list((_section_fields(loc[:-1]) or {}).keys())
        where = ".".join(loc[:-1]) or "the top level"
        return f"{source}: unknown key '{field}' in {where}; {_did_you_mean(loc[-1], options)}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        return _field_line(field, msg[len("Value error, ") :], source)
    got = err.get("input")
    got_text = "" if isinstance(got, dict) else f" (got {got!r})"
    fix = "fix the value"
    if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        fix = "use a value in range"
    elif err["type"] == "literal_error":
        fix = "use one of the listed values"
    elif "type" in err["type"] or "parsing" in err["type"]:
        fix = "use the right type"
    return f"{source}: {field}: {msg}{got_text}; {fix}"


def _field_line(field: str, message: str, source: str) -> str:
    """`source: field: message`, the field left out when the message already starts with it."""
    if not field or message.startswith(field):
        return f"{source}: {message}"
    return f"{source}: {field}: {message}"


def _blamed(field: str, source: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The override that set `field` (if one did), else `source`: where a message says the error is."""
    culprit = _override_setting(field, overrides) if field else None
    return f"override {culprit!r}" if culprit else source


def field_error(
    field: str, message: str, source: str = "config", overrides: list[str] | tuple[str, ...] = ()
) -> ConfigError:
    """A one-line ConfigError about a field that a check outside the schema found wrong (the inner
    optimizer's, muloco/optim/check.py), worded as the schema's own errors: it blames the override that
    set the field, if one did, else `source`."""
    return ConfigError(_field_line(field, message, _blamed(field, source, overrides)))


def validate(
    data: dict[str, Any], source: str = "config", overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The config, or a one-line ConfigError blaming the override that set the bad field (if one did),
    else `source`."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        field = ".".join(str(p) for p in exc.errors()[0]["loc"] if not isinstance(p, int))
        raise ConfigError(_format_validation_error(exc, _blamed(field, source, overrides))) from None


def _override_setting(field: str, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The last override that set `field` or a section holding it (`model={...}` sets model.d_model)."""
    for text in reversed(overrides):
        key = text.split("=", 1)[0].strip()
        if field == key or field.startswith(key + "."):
            return text
    return None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate a config: YAML (with `extends:`), then dotted `KEY=VALUE` overrides. Overrides that
    change the maths name the run after them unless they set run.name (`name_for_overrides`)."""
    file_data = load_raw(path) if path is not None else {}
    source = str(path) if path is not None else "config"
    data = apply_overrides(file_data, list(overrides))
    cfg = validate(data, source, overrides)
    if path is None:
        return cfg
    cfg.run.name = name_for_overrides(cfg, file_data, overrides)  # sections validate assignments
    return cfg


def _file_value(file_data: dict[str, Any], key: str) -> Any:
    node: Any = file_data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


MAX_NAME = 80  # a longer derived name becomes `<run.name>_<fingerprint>`


def name_for_overrides(cfg: Config, file_data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> str:
    """The run's name: the file's run.name, or, when command-line overrides change the config's maths
    (its fingerprint), that name with a part per such override (`quickstart_w8`, `quickstart_dp`,
    `quickstart_4bit_statistical`, `quickstart_inner.lr-0.01`; sorted by key, so the same overrides in any
    order find the same run again). So a run of another config never lands in an earlier run's directory.
    run.name given as an override is taken as it is."""
    parsed = {".".join(parts): value for parts, value in map(parse_override, overrides)}
    if "run.name" in parsed:
        return cfg.run.name
    changing = {
        key: value
        for key, value in sorted(parsed.items())
        if fingerprinted(key) and _file_value(file_data, key) != value
    }
    if not changing:
        return cfg.run.name
    try:
        if Config.model_validate(file_data).fingerprint() == cfg.fingerprint():
            return cfg.run.name  # the overrides restate the file's values
    except ValidationError:
        pass  # the file alone is not a valid config: the overrides complete it
    parts = [name_part(key, value, changing, label=key) for key, value in changing.items()]
    name = "_".join([cfg.run.name, *(p for p in parts if p)])
    return name if len(name) <= MAX_NAME else f"{cfg.run.name}_{cfg.fingerprint()[:8]}"
