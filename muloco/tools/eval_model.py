"""`muloco eval PATH`: loss, perplexity and bits per byte of a run's global parameters, or of a Hugging Face
model directory, on a val split.

PATH is a run directory (its newest checkpoint, or `--step`) or a Hugging Face model directory (one
`muloco export` wrote, or any `save_pretrained` one). The tokens are the run's own val split, or those of
`--data DIR` (prepared by `muloco data prepare`) whose tokenizer must encode like the model's. The val set
and the estimate are the trainer's (data/stream.py `val_batches`, the mean of batch means), so a run's eval
at its last step equals its summary's final_val_loss. Bits per byte: the summed loss in bits over the UTF-8
bytes the target tokens stand for (data/tokenizer.py `token_byte_lengths`), comparable across tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from muloco.config import DataConfig
from muloco.data import load_data, val_batches
from muloco.data.tokenizer import ByteTokenizer, load_bpe, token_byte_lengths
from muloco.errors import DataError, UserError
from muloco.models.hf import CONTEXT_KEYS, import_transformers
from muloco.models.lm import CausalLM
from muloco.run.build import autocast_factory, resolve_device
from muloco.run.run_dir import write_json_atomic
from muloco.tools.trained import load_trained_run

HF_DEFAULT_TOKENS = 65536  # an HF directory has no train.eval_tokens of its own
HF_BATCH_TOKENS = 8192  # sequences per batch for an HF directory: this many tokens
# Text every tokenizer must encode alike for --data to be accepted: code, accents, CJK, emoji, tabs.
PROBE_TEXT = "def f(x):\n\treturn x + 1  # héllo wörld, 世界 🚀\nThe quick brown fox jumps over the lazy dog."


@dataclass
class EvalTarget:
    """What is evaluated: a model mapping ids to logits, its encoder, where it came from."""

    model: nn.Module
    encode: Any  # text -> ids, for the tokenizer check
    seq_len: int
    description: dict[str, Any]


def _data_tokenizer(data, directory: Path):
    if data.tokenizer == "byte":
        return ByteTokenizer()
    if data.tokenizer_file is not None:
        return load_bpe(data.tokenizer_file, field=f"--data {directory}")
    raise UserError(
        f"--data: {directory} has no meta.json naming its tokenizer, so its ids cannot be checked against "
        "the model's; prepare it with `muloco data prepare`"
    )


def _check_same_tokenizer(encode, data_tokenizer, directory: Path, model_name: str) -> None:
    ours, theirs = list(encode(PROBE_TEXT)), data_tokenizer.encode_batch([PROBE_TEXT])[0]
    if ours != theirs:
        raise UserError(
            f"--data: {directory} was tokenized with another tokenizer than {model_name}'s (they encode the "
            "same text differently); prepare the data with the model's tokenizer (muloco data prepare "
            "--tokenizer ...)"
        )


def _run_target(path: Path, step: int | None) -> tuple[EvalTarget, Any, Any]:
    run = load_trained_run(path, step)
    tokenizer = run.tokenizer() if run.tokenizer_info.get("tokenizer") != "unknown" else None
    cfg = run.cfg
    description = {
        "source": str(path),
        "kind": "run",
        "step": run.weights.step,
        "checkpoint": str(run.weights.path),
    }
    encode = (lambda text: tokenizer.encode_batch([text])[0]) if tokenizer is not None else None
    return EvalTarget(run.model, encode, cfg.model.seq_len, description), cfg, tokenizer


def _hf_target(path: Path, seq_len: int | None, vocab_size: int) -> EvalTarget:
    transformers = import_transformers()
    try:
        net = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError for a foreign directory
        raise UserError(
            f"PATH: cannot load {path} as a Hugging Face model with its tokenizer ({exc})"
        ) from None
    context = next((getattr(net.config, k) for k in CONTEXT_KEYS if hasattr(net.config, k)), None)
    seq_len = seq_len or context
    if seq_len is None:
        raise UserError(f"--seq-len: {path}'s config names no context length; set --seq-len")
    model = CausalLM(net.eval(), vocab_size, seq_len, f"PATH {path}", call_kwargs={"use_cache": False})
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return EvalTarget(model.eval(), encode, seq_len, {"source": str(path), "kind": "hf"})


@torch.no_grad()
def score(model: nn.Module, val_set, byte_lengths: np.ndarray, device, autocast) -> dict[str, float]:
    """Loss (mean of batch means, as the trainer's val loss), perplexity and bits per byte."""
    model.to(device)
    losses, nats, tokens, text_bytes = [], 0.0, 0, 0
    for x, y in val_set:
        with autocast():
            loss = model(x.to(device), y.to(device)).item()
        losses.append(loss)
        nats += loss * y.numel()
        tokens += y.numel()
        text_bytes += int(byte_lengths[y.numpy()].sum())
    loss = sum(losses) / len(losses)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nats / math.log(2) / max(text_bytes, 1),
        "tokens": tokens,
        "bytes": text_bytes,
    }


def evaluate_path(
    path: str | Path,
    *,
    data: str | None = None,
    tokens: int | None = None,
    step: int | None = None,
    seq_len: int | None = None,
    device: str = "auto",
    out: str | None = None,
) -> dict[str, Any]:
    """Evaluate the run or Hugging Face directory at `path`; returns (and writes, see `out`) the result."""
    source = Path(path).expanduser()
    is_run = (source / "config.yaml").is_file()
    if not is_run and not (source / "config.json").is_file():
        raise UserError(
            f"PATH: {source} is neither a run directory (config.yaml) nor a Hugging Face model directory "
            "(config.json)"
        )
    if tokens is not None and tokens < 1:
        raise UserError("--tokens must be >= 1")
    if not is_run and step is not None:
        raise UserError("--step applies to run directories; a Hugging Face directory holds one model")
    if not is_run and data is None:
        raise UserError(
            f"--data: {source} is a Hugging Face model without a val split of its own; name token files "
            "prepared with its tokenizer (muloco data prepare ... --tokenizer DIR)"
        )
    data_dir = Path(data).expanduser() if data is not None else None
    run_cfg = None
    if data_dir is not None:
        if not data_dir.is_dir():
            raise UserError(
                f"--data: {data_dir} is not a directory; name token files from muloco data prepare"
            )
        token_data = load_data(DataConfig(source="tokens", path=str(data_dir)), 1)
        data_tokenizer = _data_tokenizer(token_data, data_dir)
    if is_run:
        target, run_cfg, run_tokenizer = _run_target(source, step)
        if seq_len is not None and seq_len != run_cfg.model.seq_len:
            raise UserError(f"--seq-len: a run is evaluated at its model.seq_len ({run_cfg.model.seq_len})")
        if data_dir is None:
            token_data, data_tokenizer = load_data(run_cfg.data, target.seq_len), run_tokenizer
        elif target.encode is None:
            raise UserError(
                f"--data: {source} trained on token files of unknown tokenizer; evaluate on its own"
            )
        else:
            _check_same_tokenizer(target.encode, data_tokenizer, data_dir, "the run")
    else:
        target = _hf_target(source, seq_len, token_data.vocab_size)
        _check_same_tokenizer(target.encode, data_tokenizer, data_dir, str(source))
    if len(token_data.val) < target.seq_len + 1:
        raise DataError(f"--data: the val split has {len(token_data.val)} tokens, fewer than a sequence")
    if run_cfg is not None:
        eval_tokens = tokens or run_cfg.train.eval_tokens
        batch_seqs = (run_cfg.train.micro_batch_tokens or run_cfg.worker_batch_tokens) // target.seq_len
        dev, precision = (
            resolve_device(run_cfg.device if device == "auto" else device),
            run_cfg.train.precision,
        )
    else:
        eval_tokens, batch_seqs = tokens or HF_DEFAULT_TOKENS, max(1, HF_BATCH_TOKENS // target.seq_len)
        dev, precision = resolve_device(device), "auto"
    val_set = val_batches(token_data.val, target.seq_len, eval_tokens, max(batch_seqs, 1))
    lengths = (
        token_byte_lengths(data_tokenizer, token_data.vocab_size)
        if data_tokenizer is not None
        else np.ones(token_data.vocab_size, dtype=np.int64)  # unknown tokenizer: bits per token
    )
    result = {
        **target.description,
        "data": str(data_dir) if data_dir is not None else "the run's val split",
        "seq_len": target.seq_len,
        **score(target.model, val_set, lengths, dev, autocast_factory(precision, dev)),
    }
    if data_tokenizer is None:
        result["bits_per_byte"] = None  # unknown tokenizer: bytes unknown
    destination = out
    if destination is None and is_run:
        name = data_dir.name if data_dir is not None else "val"
        destination = str(source / "eval" / f"step_{result['step']:08d}_{name}.json")
    if destination is not None:
        Path(destination).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(destination), result)
        result["written"] = destination
    return result
