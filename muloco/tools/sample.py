"""`muloco sample RUN_DIR`: text from the newest checkpoint of a run.

The model and tokenizer come from the run directory (tools/trained.py: the global parameters of the newest
checkpoint, the run's own tokenizer), so the data need not be present. Sampling is
autoregressive over the last `model.seq_len` tokens, with temperature and top-k, seeded: the same
arguments give the same text.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from muloco.errors import UserError
from muloco.tools.trained import load_trained_run


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
    run = load_trained_run(run_dir)
    model, tokenizer, seq_len = run.model, run.tokenizer(), run.cfg.model.seq_len
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
