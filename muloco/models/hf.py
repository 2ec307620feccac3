"""`model.hf`: a Hugging Face causal LM built from a config, random init, never downloaded.

`model.hf` is a local config.json (or a directory holding one), or a mapping of config values with a
`model_type` (and optionally `config: PATH` to start from): `AutoConfig.for_model(model_type, **values)`
then `AutoModelForCausalLM.from_config`. Unknown keys are errors (transformers would silently keep them).
The vocabulary and the context length default to the data's and model.seq_len; bos/eos/pad ids that fall
outside a smaller vocabulary are cleared. transformers is an optional extra: `pip install -e ".[hf]"`.

`model.hf: {pretrained: DIR}` is the model a `save_pretrained` directory holds, as it is (its config,
vocabulary and context); its weights are loaded at the start of a run by `load_pretrained` (models/init.py).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from muloco.errors import ConfigError, one_line

CONTEXT_KEYS = ("max_position_embeddings", "n_positions")  # Llama-style and GPT-2-style names
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, never a download
    try:
        import transformers
    except ImportError:
        raise ConfigError('model.hf needs Hugging Face transformers: pip install -e ".[hf]"') from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars on every load and save
    return transformers


def _read_config_json(path: str, field: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {file} ({exc.strerror}); name a local config.json") from None
    except ValueError as exc:
        raise ConfigError(f"{field}: {file} is not valid JSON ({exc}); fix the file") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{field}: {file} holds a {type(values).__name__}, not a JSON object")
    return values


def hf_config_values(spec: str | dict[str, Any]) -> dict[str, Any]:
    """The config values `model.hf` names: a file's, then the mapping's overrides on top."""
    if isinstance(spec, str):
        return _read_config_json(spec, "model.hf")
    overrides = dict(spec)
    path = overrides.pop("config", None)
    base = _read_config_json(str(path), "model.hf.config") if path is not None else {}
    return {**base, **overrides}


def _check_keys(config_class, values: dict[str, Any], model_type: str) -> None:
    defaults = config_class()
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for key in values:
        if key not in known and not hasattr(defaults, key):
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"model.hf.{key}: not a setting of {model_type} configs{hint}")


def pretrained_dir(spec: str | dict[str, Any] | None) -> Path | None:
    """The directory of `model.hf.pretrained`, checked to hold a saved model, or None."""
    if not isinstance(spec, dict) or spec.get("pretrained") is None:
        return None
    others = sorted(set(spec) - {"pretrained"})
    if others:
        raise ConfigError(
            f"model.hf.{others[0]}: a pretrained model keeps its own architecture; remove the key, or drop "
            "model.hf.pretrained to build a model from settings"
        )
    directory = Path(str(spec["pretrained"])).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"model.hf.pretrained: {directory} is not a directory; name one written by save_pretrained"
        )
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"model.hf.pretrained: {directory} has no config.json, so it is not a saved model; name a "
            "directory written by save_pretrained"
        )
    weights = [*directory.glob("*.safetensors"), *directory.glob("*.bin")]
    if not weights:
        raise ConfigError(
            f"model.hf.pretrained: {directory} holds no weights (*.safetensors); name a directory written "
            "by save_pretrained"
        )
    return directory


def _pretrained_config(directory: Path):
    transformers = import_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError for a foreign file
        raise ConfigError(
            f"model.hf.pretrained: {directory}/config.json is not a model config ({one_line(exc)})"
        ) from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model.hf.pretrained: {directory} holds a {config.model_type} model, which has no causal LM in "
            "transformers; name a decoder model"
        )
    return config


def load_pretrained(directory: Path) -> nn.Module:
    """The model saved in `directory`, with its weights (local files only, fp32)."""
    transformers = import_transformers()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=torch.float32
        )
    except Exception as exc:
        raise ConfigError(f"model.hf.pretrained: cannot load {directory} ({one_line(exc)[:300]})") from None


def build_hf_model(spec: str | dict[str, Any], vocab_size: int, seq_len: int) -> nn.Module:
    transformers = import_transformers()
    directory = pretrained_dir(spec)
    if directory is not None:  # the architecture only: the weights come at the run's start (init.py)
        config = _pretrained_config(directory)
        if config.vocab_size < vocab_size:
            raise ConfigError(
                f"model.hf.pretrained: the model's vocabulary has {config.vocab_size} tokens but the data's "
                f"has {vocab_size}; prepare the data with its tokenizer (muloco data prepare ... --tokenizer "
                f"{directory})"
            )
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    values = hf_config_values(spec)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.hf: name a model_type (e.g. llama, gpt2) or a config.json that has one")
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        close = difflib.get_close_matches(str(model_type), list(mapping.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"model.hf.model_type: {model_type!r} is not a model type transformers knows{hint}")
    values.pop("architectures", None)  # a saved config's record, not a setting
    values.pop("transformers_version", None)
    config_class = mapping[model_type]
    _check_keys(config_class, values, model_type)
    # A key and its alias (GPT-2's max_position_embeddings -> n_positions) are one setting.
    aliases = getattr(config_class, "attribute_map", {})
    given = {aliases.get(key, key) for key in values}
    defaults = {"vocab_size": vocab_size, **dict.fromkeys(CONTEXT_KEYS, seq_len)}
    filled = {k: v for k, v in defaults.items() if aliases.get(k, k) not in given}
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
        for key, value in filled.items():
            if hasattr(config, key):
                setattr(config, key, value)
        for key in SPECIAL_TOKEN_KEYS:  # e.g. GPT-2's 50256 in a 256-token vocabulary
            token = getattr(config, key, None)
            if key not in values and isinstance(token, int) and token >= config.vocab_size:
                setattr(config, key, None)
    except Exception as exc:  # transformers validates configs with several error types
        raise ConfigError(f"model.hf: invalid {model_type} config ({one_line(exc)})") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model.hf: {model_type} has no causal LM in transformers; pick a decoder model type"
        )
    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:
        raise ConfigError(f"model.hf: cannot build {model_type} ({one_line(exc)})") from None
