"""A finished (or running) run, rebuilt for use: its config, tokenizer and model with trained weights.

The model is rebuilt from the run's `config.yaml` and loaded with one checkpoint's global parameters
(checkpoint/weights.py); the tokenizer comes from the run directory (`tokenizer_info.json`,
`tokenizer.json`), so the data need not be present. `muloco sample`, `export` and `eval` start here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from muloco.checkpoint.weights import RunWeights, load_weights, read_run_weights
from muloco.config import Config, load_config
from muloco.data.tokenizer import BpeTokenizer, ByteTokenizer, load_run_tokenizer
from muloco.errors import UserError, one_line
from muloco.models import build_model
from muloco.run.run_dir import TOKENIZER_RECORD


@dataclass
class TrainedRun:
    run_dir: Path
    cfg: Config
    tokenizer_info: dict  # {"vocab_size": V, "tokenizer": "byte" | "tokenizer.json" | "unknown"}
    weights: RunWeights
    model: nn.Module  # in eval mode, holding `weights`

    def tokenizer(self) -> ByteTokenizer | BpeTokenizer:
        return load_run_tokenizer(self.run_dir, self.tokenizer_info)


def tokenizer_info(run_dir: Path, cfg: Config) -> dict:
    path = run_dir / TOKENIZER_RECORD
    if path.is_file():
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
            int(info["vocab_size"])
            return info
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"RUN_DIR: {path} is unreadable ({one_line(exc)}); rerun or restore it") from None
    if cfg.data.source in ("builtin", "text"):  # runs from before the record existed: bytes
        return {"vocab_size": cfg.data.vocab_size or ByteTokenizer.vocab_size, "tokenizer": "byte"}
    raise UserError(f"RUN_DIR: {run_dir} has no {TOKENIZER_RECORD}; run it again with this muloco")


def load_trained_run(run_dir: str | Path, step: int | None = None) -> TrainedRun:
    """The run in `run_dir` with the global parameters of its newest checkpoint (or of `step`)."""
    directory = Path(run_dir).expanduser()
    if not (directory / "config.yaml").is_file():
        raise UserError(
            f"RUN_DIR: {directory} has no config.yaml; name a run directory such as runs/quickstart"
        )
    cfg = load_config(str(directory / "config.yaml"))
    info = tokenizer_info(directory, cfg)
    weights = read_run_weights(directory, step)
    model = build_model(cfg.model, int(info["vocab_size"]))
    load_weights(model, weights)
    return TrainedRun(directory, cfg, info, weights, model.eval())
