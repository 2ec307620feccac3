"""`muloco export RUN_DIR OUT`: a run's trained weights as a Hugging Face model directory.

OUT holds config.json, model.safetensors, generation_config.json and the run's tokenizer (tokenizer.json
with its tokenizer_config.json), which `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load offline with no custom code. A `model.hf` run exports its own
architecture; the built-in GPT exports as GPT-2 (models/gpt2.py), computing the same logits; a factory
model has no standard counterpart and is refused. Byte-level runs get a tokenizer whose ids are the bytes
(data/tokenizer.py). OUT is written beside itself and renamed into place: complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from muloco.data.tokenizer import BpeTokenizer, ByteTokenizer, byte_tokenizer_for_hf
from muloco.errors import UserError
from muloco.models.gpt2 import export_problem, gpt2_config_values, gpt2_state_dict
from muloco.models.hf import import_transformers
from muloco.run.run_dir import TOKENIZER_FILE
from muloco.tools.trained import TrainedRun, load_trained_run
from muloco.version import __version__

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROVENANCE = "muloco_export.json"  # which run, step and checkpoint OUT holds


def check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT: {out} is a file; name a directory to export to")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(
            f"OUT: {out} exists and is not empty; pass --force to replace it, or name a new directory"
        )


def hf_model(run: TrainedRun, eot: int | None) -> nn.Module:
    """The Hugging Face model of the run, holding its trained weights."""
    cfg = run.cfg.model
    if cfg.factory is not None:
        raise UserError(
            f"model.factory={cfg.factory}: your own model has no standard Hugging Face architecture; export "
            "works for the built-in GPT and model.hf runs (load a factory run's weights with muloco.tools."
            "trained.load_trained_run)"
        )
    if cfg.hf is not None:
        return run.model.net
    problem = export_problem(cfg)
    if problem is not None:
        raise UserError(problem)
    transformers = import_transformers()
    values = gpt2_config_values(cfg, int(run.tokenizer_info["vocab_size"]), eot)
    values.pop("model_type")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**values))
    params = dict(run.model.named_parameters())
    model.load_state_dict(gpt2_state_dict(params, cfg.n_layers), strict=True)
    return model.eval()


def hf_tokenizer(run: TrainedRun, tokenizer: ByteTokenizer | BpeTokenizer):
    """The run's tokenizer as a transformers fast tokenizer (saved as tokenizer.json + its config)."""
    transformers = import_transformers()
    eot = tokenizer.eot
    max_length = run.cfg.model.seq_len
    if isinstance(tokenizer, ByteTokenizer):
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=byte_tokenizer_for_hf(), model_max_length=max_length
        )
    eos = tokenizer.tokenizer.id_to_token(eot) if eot is not None else None
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(run.run_dir / TOKENIZER_FILE),
        model_max_length=max_length,
        **({"eos_token": eos, "pad_token": eos} if eos is not None else {}),
    )


def _fsync_tree(directory: Path) -> None:
    """The files' bytes, then the directory's entries."""
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def export_run(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "fp32", force: bool = False
) -> Path:
    """Write the run's model (newest checkpoint, or `step`) to `out` as a Hugging Face directory."""
    out = Path(out).expanduser().absolute()
    check_out(out, force)
    run = load_trained_run(run_dir, step)
    run_tokenizer = run.tokenizer()
    eot = run_tokenizer.eot
    model = hf_model(run, eot)
    tokenizer = hf_tokenizer(run, run_tokenizer)
    if getattr(model.generation_config, "eos_token_id", None) is None and eot is not None:
        model.generation_config.eos_token_id = eot  # generate() stops at the end of a document
        model.generation_config.pad_token_id = eot
    model.to(DTYPES[dtype])
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp_{out.name}_", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        provenance = {
            "run_dir": str(run.run_dir.absolute()),
            "checkpoint": str(run.weights.path),
            "step": run.weights.step,
            "dtype": dtype,
            "architecture": type(model).__name__,
            "muloco_version": __version__,
        }
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
        _fsync_tree(staging)
        replaced = None
        if out.exists():  # empty, or --force: moved aside, then removed once the new one is in place
            replaced = Path(tempfile.mkdtemp(prefix=f".tmp_replaced_{out.name}_", dir=out.parent))
            os.replace(out, replaced / out.name)
        os.replace(staging, out)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


__all__ = ["export_run"]
