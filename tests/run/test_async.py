"""Asynchronous outer updates in a simulation (run/async_rounds.py): the windows arrive in the order the
virtual clock gives, each applied at once by delayed Nesterov worked by hand here; a run interrupted
mid-run resumes bit for bit; bad settings are refused in one line."""

import json

import pytest
import torch
from interrupts import interrupted_and_resumed
from test_helpers import DelayedNesterovByHand

from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.run.trainer import Trainer

# K = 2 at speeds 1 and 0.5, windows of H = 2 steps, 6 steps a worker's budget (12 in all), a constant lr.
ASYNC = [
    "workers=2",
    "train.total_tokens=1536",
    "sync.every=2",
    "sync.mode=async",
    "train.speed=[1.0, 0.5]",
    "train.lr_schedule=constant",
    "train.warmup_steps=0",
    "inner.optimizer=adamw",
]
# The windows end at virtual times 2 (w0), 4 (w0, then w1: ties go to the lower worker), 6 (w0), 8 (w0,
# then w1); w0's pull at 8 finds the budget spent. Staleness: the arrivals between a pull and its arrival.
ORDER = [0, 0, 1, 0, 0, 1]
STALENESS = [0, 0, 2, 1, 0, 2]


def delayed_nesterov_by_hand(overrides, lr: float, beta: float, every: int) -> list[torch.Tensor]:
    """The trainer's own replicas stepped by hand in ORDER, each window from the global parameters the
    worker last pulled, and Liu et al.'s Algorithm 3 (c = 0) written out: every arrival
    theta -= lr g / N; every N-th also m <- beta m + (the window's sum) / N and theta -= lr beta m."""
    trainer = Trainer(load_config(None, overrides))
    replicas = trainer.replicas
    theta = [p.detach().clone() for p in replicas[0].model.parameters()]
    pulled = [[p.clone() for p in theta] for _ in replicas]
    outer = DelayedNesterovByHand(theta, lr, beta, every)
    for w in ORDER:
        replica = replicas[w]
        for _ in range(2):
            replica.train_step(trainer.micro_batches, trainer.seqs_per_micro, 1.0, 1.0, trainer.autocast)
        outer.arrive([b - p.detach() for b, p in zip(pulled[w], replica.model.parameters(), strict=True)])
        pulled[w] = [p.clone() for p in theta]
        with torch.no_grad():
            for q, p in zip(replica.model.parameters(), theta, strict=True):
                q.copy_(p)
    return theta


@pytest.mark.parametrize("every", [1, 2])
def test_async_windows_arrive_in_clock_order_under_delayed_nesterov(tiny, every):
    outer = ["outer.lr=0.7", "outer.momentum=0.9", f"sync.momentum_every={every}"]
    trainer = Trainer(load_config(None, [*tiny, *ASYNC, *outer, "run.name=async"]))
    summary = trainer.run()
    expected = delayed_nesterov_by_hand([*tiny, *ASYNC, *outer, "run.name=hand"], 0.7, 0.9, every)
    for a, b in zip(expected, trainer.engine.outer.params, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    assert [r["worker"] for r in syncs] == ORDER and [r["staleness"] for r in syncs] == STALENESS
    assert summary["tokens_seen"] == 12 * 128 and summary["inner_steps"] == 6
    assert [r.inner_steps for r in trainer.replicas] == [8, 4]  # the faster worker took two thirds
    # The run ends on one model: every replica holds the global parameters.
    for p, q in zip(trainer.replicas[1].model.parameters(), trainer.engine.outer.params, strict=True):
        assert torch.equal(p.detach(), q)


def test_the_lr_schedule_follows_the_virtual_clock(tiny):
    """A step taken at virtual time t uses the schedule at t x sum(v) / K: speeds 1 and 0.5 give 0.75."""
    trainer = Trainer(load_config(None, [*tiny, *ASYNC, "train.lr_schedule=cosine"]))
    rounds = trainer.async_rounds
    assert [rounds._schedule_step(t) for t in (0, 1, 2, 4, 7.99, 100)] == [0, 0, 1, 3, 5, 5]


def test_an_async_run_interrupted_resumes_exactly(tiny):
    overrides = [*tiny, *ASYNC, "compression.scheme=statistical", "compression.bits=4"]
    overrides += ["compression.error_feedback=true", "checkpoint.every=1"]
    # Inside the slow worker's first window: the window finishes, is applied, then the run stops.
    state, _ = interrupted_and_resumed(overrides, replica=1, after_step=1)
    assert state["async"]["book"]["arrivals"] == 3  # w0, w0, then w1's window that the signal fell in


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["backend.kind=torchft"], "global parameters, which backend.kind=torchft does not"),
        (["backend.kind=hivemind"], "global parameters, which backend.kind=hivemind does not"),
        (["method=dp"], "sync.mode=async runs DiLoCo"),
        (["backend.kind=torch", "checkpoint.every=2"], "checkpoint.every=0"),
        (["backend.kind=torch", "sync.pacing=by_speed"], "sync.pacing_speeds=declared"),
        (["sync.fragments=2"], "use one fragment without overlap"),
        (["sync.aggregate=median"], "there is no mean to aggregate"),
        (["sync.momentum_every=0"], "momentum_every"),
        (["diagnostics.alignment=true"], "diagnostics.alignment needs"),
    ],
)
def test_bad_async_settings_are_refused_in_one_line(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [*tiny, "sync.mode=async", *overrides])
    assert "\n" not in str(info.value)
