"""A run interrupted by SIGINT partway and resumed, beside the same run uninterrupted: the reliability,
pacing and async tests compare the two."""

import signal

import torch

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.run.trainer import Trainer


def interrupted_and_resumed(overrides: list[str], replica: int, after_step: int) -> tuple[dict, Trainer]:
    """Runs `overrides` in full, then again with SIGINT raised while replica `replica` takes the inner step
    after its step `after_step`, then resumes that run to its end. Returns the interrupted run's last
    checkpoint and the resumed trainer, whose global parameters equal the full run's bit for bit."""
    full = Trainer(load_config(None, [*overrides, "run.name=full"]))
    full.run()
    cut = Trainer(load_config(None, [*overrides, "run.name=cut"]))
    watched = cut.replicas[replica]
    original_step = watched.train_step

    def step_then_signal(*args, **kwargs):
        loss = original_step(*args, **kwargs)
        if watched.inner_steps == after_step:
            signal.raise_signal(signal.SIGINT)  # run() installed the trainer's handler
        return loss

    watched.train_step = step_then_signal
    assert cut.run()["status"] == "interrupted"
    state = load_checkpoint(list_checkpoints(cut.checkpoint_dir)[-1])
    resumed = Trainer(load_config(None, [*overrides, "run.name=cut"]))
    assert resumed.run()["status"] == "completed"
    for a, b in zip(full.engine.outer.params, resumed.engine.outer.params, strict=True):
        assert torch.equal(a, b)
    return state, resumed
