"""Shared helpers for tests (importable because pyproject sets pytest's pythonpath to tests/)."""

import torch

from muloco.data import ReplicaStream
from muloco.lr_schedule import lr_multiplier
from muloco.models import build_model
from muloco.optim import build_inner_optimizer
from muloco.replica import set_lr_multiplier


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def hand_inner_steps(cfg, trainer, replica_index, steps):
    """Train a fresh copy of the initial model on replica r's stream, as a real worker would."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, 256)
    opt = build_inner_optimizer(model, cfg.inner)
    stream = ReplicaStream(trainer.data.train, cfg.model.seq_len, replica_index, cfg.workers, cfg.run.seed)
    seqs = cfg.worker_batch_tokens // cfg.model.seq_len
    for step in range(steps):
        t = cfg.train
        set_lr_multiplier(
            opt, lr_multiplier(step, cfg.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)
        )
        x, y = stream.next_batch(seqs)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params_of(model)
