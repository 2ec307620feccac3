"""The DiLoCo/MuLoCo engine against hand-derived references (DiLoCo, Douillard et al. 2023, Algorithm 1)."""

import torch
from test_helpers import hand_inner_steps

from muloco.config import load_config
from muloco.run.trainer import Trainer


def test_one_outer_step_equals_hand_computed_nesterov(tiny):
    cfg = load_config(
        None,
        [
            *tiny,
            "workers=2",
            "train.batch_tokens=512",
            "train.total_tokens=1024",
            "sync.every=2",
            "inner.optimizer=adamw",
            "outer.lr=0.7",
            "outer.momentum=0.6",
        ],
    )
    trainer = Trainer(cfg)
    theta0 = [p.clone() for p in trainer.engine.outer.params]
    trainer.run()
    locals_ = [hand_inner_steps(cfg, trainer, r, 2) for r in range(2)]
    for i, theta in enumerate(theta0):
        delta = ((theta - locals_[0][i]) + (theta - locals_[1][i])) / 2
        # First outer step: b = delta; Nesterov u = delta + m b = (1 + m) delta.
        expected = theta - 0.7 * (1 + 0.6) * delta
        assert torch.allclose(trainer.engine.outer.params[i], expected, atol=1e-6)


def test_replicas_restart_identical_and_keep_their_inner_state(tiny):
    trainer = Trainer(
        load_config(None, [*tiny, "workers=4", "train.batch_tokens=512", "inner.optimizer=adamw"])
    )
    trainer.run()
    for replica in trainer.replicas:
        for p, g in zip(replica.model.parameters(), trainer.engine.outer.params, strict=True):
            assert torch.equal(p, g)
        # AdamW's step counter counts every inner step of the run: state persisted across rounds.
        state = next(iter(replica.optimizer.optimizers[0].state.values()))
        assert int(state["step"]) == trainer.total_steps
    # Replicas read disjoint data: chunk ids of their streams never coincide within an epoch.
    seen = [set(r.stream.chunk_ids(0, r.stream.position).tolist()) for r in trainer.replicas]
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))
