"""Workers of different speeds (run/pacing.py): pacing by speed (DyLU) takes each worker's share of a round,
weighted or not, exactly as the replicas stepped by hand; emulated speeds show in the step times and the
virtual clock; measured step times are exchanged during the next round; resume is exact; bad settings are
refused in one line."""

import json
from types import SimpleNamespace

import pytest
import torch
from interrupts import interrupted_and_resumed

from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.run.pacing import Pacing, SpeedClock
from muloco.run.trainer import Trainer

# K = 3 at speeds 1, 0.5, 0.25 with H = 4: each round the workers take 4, 2 and 1 inner steps.
SPEEDS = ["workers=3", "train.batch_tokens=384", "train.total_tokens=3072", "sync.every=4"]
BY_SPEED = [*SPEEDS, "train.speed=[1.0, 0.5, 0.25]", "sync.pacing=by_speed"]
# Outer SGD at lr 1 without momentum: the new global parameters are the (weighted) mean of the replicas'.
PLAIN_OUTER = ["outer.lr=1.0", "outer.momentum=0.0", "outer.nesterov=false", "inner.optimizer=adamw"]


def test_dylu_sizes_each_workers_round_to_its_speed():
    pacing = Pacing([1.0, 0.5, 0.25, 0.3], every=10, by_speed=True)
    assert [pacing.steps_in_round(w, 10) for w in range(4)] == [10, 5, 2, 3]  # floor(v / v_max x H)
    assert [pacing.stop_at(w, 20) for w in range(4)] == [20, 15, 12, 13]  # the round [10, 20)
    assert pacing.steps_in_round(3, 2) == 1  # never less than one step: floor(0.6) -> 1
    assert pacing.stop_at(1, 25) == 22  # the run's last round, 5 steps long: floor(2.5)
    # Up to step 25 (H = 10, the run ends at 25): rounds of 10, 10 and 5 steps.
    assert pacing.worker_steps_until(25, 25) == 2 * (10 + 5 + 2 + 3) + (5 + 2 + 1 + 1)
    fixed = Pacing([1.0, 0.5], every=10, by_speed=False)
    assert fixed.stop_at(1, 20) == 20 and fixed.worker_steps_until(25, 25) == 50
    # Relative to the fastest worker, not to 1: speeds 0.5 and 0.25 pace as 1 and 0.5.
    assert Pacing([0.5, 0.25], every=4, by_speed=True).steps_in_round(1, 4) == 2


def test_measured_step_times_set_the_speeds_of_the_next_rounds():
    pacing = Pacing([1.0, 1.0, 1.0], every=4, by_speed=True, measured=True)
    pacing.close_round(4, [(0.4, 4), (0.8, 4), (0.0, 0)])  # the third worker took no step: keeps its speed
    assert pacing.speeds == [1.0, 0.5, 1.0] and pacing.trained_steps == 12
    assert [pacing.stop_at(w, 8) for w in range(3)] == [8, 6, 8]
    pacing.close_round(8, [(0.4, 4), (0.4, 2), (1.6, 4)])
    assert pacing.speeds == [1.0, 0.5, 0.25] and pacing.trained_steps == 12 + 10
    assert pacing.worker_steps_until(8, 100) == 22  # measured: the rounds counted as they ran
    declared = Pacing([1.0, 0.5, 0.25], every=4, by_speed=True)
    declared.close_round(4, [(0.4, 4), (0.4, 4), (0.4, 4)])
    assert declared.speeds == [1.0, 0.5, 0.25]  # declared speeds stay


class AllReduceByHand:
    """Two processes' backend as one of them sees it: the sum is its own plus the other's times (an
    all-reduce in flight until waited)."""

    world_size = 2

    def __init__(self, others):
        self.others, self.started = list(others), 0

    def all_reduce_sum(self, tensors):
        other = torch.tensor(self.others.pop(0), dtype=torch.float64)
        self.started += 1
        return SimpleNamespace(wait=lambda: [tensors[0] + other])


def test_measured_step_times_are_exchanged_during_the_next_round_and_a_checkpoint_keeps_them():
    """The all-reduce of a round's step times is waited at the next round's close: the speeds lag a round
    (a blocking one cost a collective before every sync); a checkpoint between holds its result."""
    backend = AllReduceByHand([[(0.0, 0), (0.8, 4)], [(0.0, 0), (1.6, 4)], [(0.0, 0), (0.4, 4)]])
    pacing = Pacing([1.0, 1.0], every=4, by_speed=True, measured=True)
    assert pacing.exchange(backend, ((0.4, 4), (0.0, 0))) == []  # round 1: nothing measured yet
    assert backend.started == 1
    assert pacing.exchange(backend, ((0.4, 4), (0.0, 0))) == [(0.4, 4), (0.8, 4)]  # round 1's, in round 2
    state = pacing.state_dict()  # mid-run: round 2's all-reduce, settled into the checkpoint
    assert state["previous_times"] == [[0.4, 4.0], [1.6, 4.0]] and pacing.pending is None
    resumed = Pacing([1.0, 1.0], every=4, by_speed=True, measured=True)
    resumed.load_state_dict(state)
    for p in (pacing, resumed):  # the run and its resumed copy read the same round 2 at round 3
        assert p.exchange(AllReduceByHand([[(0.0, 0), (0.4, 4)]]), ((0.4, 4), (0.0, 0))) == [
            (0.4, 4),
            (1.6, 4),
        ]
    declared = Pacing([1.0, 0.5], every=4, by_speed=True)
    assert declared.exchange(backend, ((0.4, 4), (0.0, 0))) == [] and backend.started == 2  # no collective


def test_measured_speeds_within_the_tolerance_of_the_fastest_pace_as_the_fastest():
    """Equal hosts measure a few percent apart: without a tolerance the floor takes a step from each."""
    noisy = [(0.40, 15), (0.41, 15), (0.42, 15), (0.80, 15)]
    exact = Pacing([1.0] * 4, every=15, by_speed=True, measured=True)
    exact.close_round(15, noisy)
    assert [exact.steps_in_round(w, 15) for w in range(4)] == [15, 14, 14, 7]
    tolerant = Pacing([1.0] * 4, every=15, by_speed=True, measured=True, tolerance=0.05)
    tolerant.close_round(15, noisy)
    assert tolerant.speeds == [1.0, 1.0, 1.0, 0.5]
    assert [tolerant.steps_in_round(w, 15) for w in range(4)] == [15, 15, 15, 7]


def test_token_weights_are_each_workers_share_times_k():
    pacing = Pacing([1.0, 0.5, 0.25], every=4, by_speed=True, weight_by_tokens=True)
    weights = [pacing.weight(w, 8) for w in range(3)]  # steps 4, 2, 1 of 7
    assert weights == pytest.approx([12 / 7, 6 / 7, 3 / 7]) and sum(weights) == pytest.approx(3)
    assert Pacing([1.0, 0.5], every=4, by_speed=True).weight(1, 8) == 1.0  # the plain mean


def test_the_virtual_clock_advances_by_the_slowest_emulated_worker():
    clock = SpeedClock(simulated=True)
    # 7 steps measured in 0.7 s together: 0.1 s a step, emulated 0.1 / v
    emulated = clock.advance([1.0, 0.5, 0.25], [4, 2, 1], 0.7)
    assert emulated == pytest.approx([0.4, 0.4, 0.4]) and clock.virtual_s == pytest.approx(0.4)
    clock.advance([1.0, 0.5], [4, 4], 0.8)  # fixed pacing: the half-speed worker takes 0.8 s
    assert clock.virtual_s == pytest.approx(1.2) and clock.summary() == {"virtual_time_s": 1.2}


def hand_stepped(overrides, weighted: bool) -> list[torch.Tensor]:
    """The reference: the trainer's own replicas, each stepped by hand for its share of every round, and
    the global parameters set to their (token-weighted) mean, as outer SGD at lr 1 gives."""
    trainer = Trainer(load_config(None, overrides))
    replicas, steps = trainer.replicas, [4, 2, 1]
    params = [p.detach().clone() for p in replicas[0].model.parameters()]
    for start in range(0, trainer.total_steps, 4):
        for replica, count in zip(replicas, steps, strict=True):
            for step in range(start, start + count):
                lr = trainer._lr_multiplier(step)
                replica.train_step(trainer.micro_batches, trainer.seqs_per_micro, lr, 1.0, trainer.autocast)
        weights = [3 * s / sum(steps) for s in steps] if weighted else [1.0, 1.0, 1.0]
        for i, p in enumerate(params):
            locals_ = [list(r.model.parameters())[i].detach() for r in replicas]
            mean = sum(w * (p - q) for w, q in zip(weights, locals_, strict=True)) / 3
            params[i] = p - mean
        for replica in replicas:
            with torch.no_grad():
                for q, p in zip(replica.model.parameters(), params, strict=True):
                    q.copy_(p)
    return params


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_pacing_by_speed_equals_the_replicas_stepped_by_hand(tiny, batched, weighted):
    overrides = [*tiny, *BY_SPEED, *PLAIN_OUTER, f"simulation.batched={str(batched).lower()}"]
    overrides += [f"sync.weight_by_tokens={str(weighted).lower()}"]
    trainer = Trainer(load_config(None, [*overrides, "run.name=paced"]))
    summary = trainer.run()
    expected = hand_stepped([*overrides, "run.name=hand"], weighted)
    for a, b in zip(expected, trainer.engine.outer.params, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    # Two rounds of 4 + 2 + 1 steps at 128 tokens a worker's step.
    assert summary["tokens_seen"] == 2 * 7 * 128 and summary["inner_steps"] == 8


def test_emulated_speeds_show_in_the_step_times_and_the_virtual_clock(tiny):
    fixed = Trainer(load_config(None, [*tiny, *SPEEDS, "train.speed=[1.0, 0.5, 0.25]", "run.name=fixed"]))
    summary = fixed.run()
    records = [json.loads(line) for line in (fixed.run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    assert len(syncs) == 2 and summary["tokens_seen"] == 2 * 12 * 128
    for record in syncs:  # the round's measured step time, at each worker's speed
        fast, half, quarter = record["step_s"]
        assert half == pytest.approx(2 * fast, rel=1e-3) and quarter == pytest.approx(4 * fast, rel=1e-3)
    # Fixed pacing: every round waits for the quarter-speed worker's 4 steps.
    rounds = sum(4 * r["step_s"][2] for r in syncs)
    assert summary["virtual_time_s"] == pytest.approx(rounds, rel=1e-3, abs=1e-3)  # written to 1 ms


def test_in_a_simulation_the_measured_speeds_are_the_emulated_ones(tiny):
    """The virtual clock charges each worker the round's mean step time over its speed, so pacing by
    measured step times paces by train.speed exactly: the two runs end bit for bit alike."""
    overrides = [*tiny, *BY_SPEED, "inner.optimizer=adamw"]
    measured = Trainer(load_config(None, [*overrides, "run.name=measured"]))
    declared = Trainer(load_config(None, [*overrides, "sync.pacing_speeds=declared", "run.name=declared"]))
    assert measured.run()["tokens_seen"] == declared.run()["tokens_seen"] == 2 * 7 * 128
    assert measured.pacing.speeds == pytest.approx([1.0, 0.5, 0.25], rel=1e-9)
    for a, b in zip(measured.engine.outer.params, declared.engine.outer.params, strict=True):
        assert torch.equal(a, b)


def test_the_virtual_clock_charges_the_emulated_speeds_not_the_pacings(tiny, monkeypatch):
    """Measured pacing rescales the speeds to the fastest worker's 1 after the first round; the clock must
    still charge each worker the speed train.speed emulates (both at 0.5: every round at half speed)."""
    charged = []
    advance = SpeedClock.advance

    def recording(self, speeds, steps, seconds):
        charged.append(list(speeds))
        return advance(self, speeds, steps, seconds)

    monkeypatch.setattr(SpeedClock, "advance", recording)
    overrides = [*tiny, *SPEEDS, "workers=2", "train.speed=[0.5, 0.5]", "sync.pacing=by_speed"]
    trainer = Trainer(load_config(None, overrides))
    trainer.run()
    assert trainer.pacing.speeds == pytest.approx([1.0, 1.0], rel=0.5)  # measured, relative to the fastest
    assert charged == [[0.5, 0.5], [0.5, 0.5]]


def test_a_by_speed_run_interrupted_mid_round_resumes_exactly(tiny):
    overrides = [*tiny, *BY_SPEED, "simulation.batched=false", "inner.optimizer=adamw"]
    # During the second round's third step of the fastest worker
    state, _ = interrupted_and_resumed(overrides, replica=0, after_step=6)
    assert [r["inner_steps"] for r in state["replicas"]] == [7, 4, 4]  # the others have not started


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.speed=1.5"], r"train.speed \(1.5\) must be in \(0, 1\]"),
        (["train.speed=[1.0, 0.5]"], "train.speed lists 2 speeds for 3 workers"),
        (
            ["sync.pacing=by_speed", "sync.fragments=2"],
            "sync.pacing=by_speed sizes each worker's whole round",
        ),
        (["sync.weight_by_tokens=true"], "set sync.pacing=by_speed and sync.aggregate=mean"),
        (["method=dp", "train.speed=0.5"], "with method: dp leave it at 1.0"),
        (["sync.pacing=by_speed", "backend.kind=hivemind"], "set sync.pacing_speeds=declared"),
    ],
)
def test_bad_pacing_settings_are_refused_in_one_line(tiny, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*tiny, *SPEEDS, *overrides])
