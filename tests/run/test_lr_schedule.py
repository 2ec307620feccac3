"""The inner lr schedules (muloco/run/lr_schedule.py) against values worked out by hand, and a run that
follows wsd step by step."""

import json
from pathlib import Path

import pytest

from muloco.config import load_config
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.trainer import Trainer

QS = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def test_wsd_is_warmup_then_flat_then_a_linear_decay_over_its_last_fraction():
    # 110 steps, 10 of warmup, 20% of the other 100 decay: steps 90..109 go from 1 down towards 0.1.
    wsd = [lr_multiplier(s, 110, 10, "wsd", 0.1, decay_fraction=0.2) for s in range(110)]
    assert wsd[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert wsd[10:90] == [1.0] * 80
    assert wsd[90] == 1.0 and wsd[91] == pytest.approx(1 - 0.9 / 20) and wsd[100] == pytest.approx(0.55)
    assert wsd[109] == pytest.approx(1 - 0.9 * 19 / 20)
    # The decay is placed by the run's own horizon: a run twice as long is flat for longer.
    longer = [lr_multiplier(s, 210, 10, "wsd", 0.1, decay_fraction=0.2) for s in range(210)]
    assert (
        longer[:170] == [*wsd[:10], *[1.0] * 160]
        and longer[170] == 1.0
        and longer[190] == pytest.approx(0.55)
    )


def test_cosine_and_constant_are_unchanged():
    assert lr_multiplier(10, 110, 10, "cosine", 0.1) == 1.0
    assert lr_multiplier(60, 110, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_multiplier(60, 110, 10, "constant", 0.1) == 1.0


def test_a_wsd_run_logs_the_schedule_and_only_then_fingerprints_decay_fraction(tiny):
    args = ["method=dp", "train.lr_schedule=wsd", "train.decay_fraction=0.5", "train.log_every=1"]
    cfg = load_config(QS, [*tiny, *args])
    trainer = Trainer(cfg)
    seen = []
    original = trainer.dp.step
    trainer.dp.step = lambda multiplier, autocast: seen.append(multiplier) or original(multiplier, autocast)
    trainer.run()
    T, W = cfg.total_steps, cfg.train.warmup_steps
    assert seen == [lr_multiplier(s, T, W, "wsd", cfg.train.min_lr_ratio, 0.5) for s in range(T)]
    assert seen[-1] < 1.0 and 1.0 in seen
    assert json.loads((trainer.run_dir / "summary.json").read_text())["status"] == "completed"
    # decay_fraction changes the maths of wsd runs only: older checkpoints keep their fingerprint.
    base = load_config(QS, tiny)
    assert base.fingerprint() == load_config(QS, [*tiny, "train.decay_fraction=0.5"]).fingerprint()
    assert cfg.fingerprint() != load_config(QS, [*tiny, *args[:2]]).fingerprint()
