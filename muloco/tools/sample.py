"""`muloco sample RUN_DIR`: text from the newest checkpoint of a run.

The model is rebuilt from the run's `config.yaml` and loaded with the global parameters (DiLoCo: the outer
optimizer's copy, which every worker starts each round from; dp: the one model); the tokenizer comes from
the run directory (`tokenizer_info.json`, `tokenizer.json`), so the data need not be present. Sampling is
autoregressive over the last `model.seq_len` tokens, with temperature and top-k, seeded: the same
arguments give the same text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from muloco.checkpoint.plain import find_resume_state
from muloco.checkpoint.sharded import list_sharded, load_sharded, newest_intact
from muloco.config import load_config
from muloco.data.tokenizer import ByteTokenizer, load_run_tokenizer
from muloco.errors import CheckpointError, UserError, one_line
from muloco.models import build_model
from muloco.run.run_dir import TOKENIZER_RECORD


def _tokenizer_info(run_dir: Path, cfg) -> dict:
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
    raise UserError(f"RUN_DIR: {run_dir} has no {TOKENIZER_RECORD}; run it again with this muloco to sample")


def load_trained_model(run_dir: Path) -> tuple[nn.Module, object, int]:
    """(model with the newest checkpoint's global parameters, tokenizer, model.seq_len)."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError(
            f"RUN_DIR: {run_dir} has no config.yaml; name a run directory such as runs/quickstart"
        )
    cfg = load_config(str(run_dir / "config.yaml"))
    info = _tokenizer_info(run_dir, cfg)
    if cfg.sharding == "fsdp":  # the newest sharded checkpoint, read whole (sharded_checkpoint.py)
        directory = run_dir / "checkpoints" / "sharded"
        newest, problem = newest_intact(list_sharded(directory))
        if problem:
            raise CheckpointError(problem)
        found = (directory / newest, load_sharded(directory / newest, "replica0", None)) if newest else None
    else:
        found = find_resume_state("auto", run_dir / "checkpoints")
    if found is None:
        raise UserError(
            f"RUN_DIR: {run_dir} has no checkpoint yet; wait for one (checkpoint.every) or the run to end"
        )
    path, state = found
    model = build_model(cfg.model, int(info["vocab_size"]))
    try:
        if "engine" in state:
            outer = state["engine"]["outer"]
            named = dict(model.named_parameters())
            if sorted(outer["names"]) != sorted(named):
                raise ValueError("other parameter names")
            with torch.no_grad():
                for name, value in zip(outer["names"], outer["params"], strict=True):
                    named[name].copy_(value)
        else:
            model.load_state_dict(state["replicas"][0]["model"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model the run's config.yaml builds now ({one_line(exc)}); "
            "did the model's code or the data's vocabulary change?"
        ) from None
    return model.eval(), load_run_tokenizer(run_dir, info), cfg.model.seq_len


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: list[int],
    tokens: int,
    *,
    seq_len: int,
    vocab_size: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
) -> list[int]:
    """`tokens` new ids after `prompt_ids`."""
    idx = torch.tensor([prompt_ids], dtype=torch.long)  # (1, T)
    out: list[int] = []
    for _ in range(tokens):
        logits = model(idx[:, -seq_len:])[0, -1, :vocab_size].float()  # (vocab,)
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < vocab_size:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        out.append(next_id)
        idx = torch.cat([idx, torch.tensor([[next_id]])], dim=1)
    return out


def sample_run(
    run_dir: str,
    *,
    prompt: str = "",
    tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    samples: int = 1,
) -> list[str]:
    """`samples` texts (the prompt and its continuation) from the run in `run_dir`."""
    if tokens < 1 or samples < 1 or not math.isfinite(temperature) or temperature < 0 or top_k < 0:
        raise UserError("--tokens and --samples must be >= 1, --temperature and --top-k >= 0")
    directory = Path(run_dir).expanduser()
    model, tokenizer, seq_len = load_trained_model(directory)
    prompt_ids = tokenizer.encode_batch([prompt])[0] if prompt else []
    if not prompt_ids:  # start where a document starts: after an end-of-text
        prompt_ids = [tokenizer.eot if tokenizer.eot is not None else 0]
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(samples):
        new = generate(
            model,
            prompt_ids,
            tokens,
            seq_len=seq_len,
            vocab_size=tokenizer.vocab_size,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
        )
        texts.append(prompt + tokenizer.decode(new))
    return texts
