"""The DiLoCo/MuLoCo engine against hand-derived references (DiLoCo, Douillard et al. 2023, Algorithm 1)."""

import copy

import torch
from test_helpers import hand_inner_steps, params_of

from muloco import DiLoCo
from muloco.config import load_config
from muloco.data import ReplicaStream
from muloco.lr_schedule import lr_multiplier
from muloco.models import build_model
from muloco.optim import build_inner_optimizer
from muloco.replica import set_lr_multiplier
from muloco.trainer import Trainer


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
    theta0 = [p.clone() for p in trainer.outer.params]
    trainer.run()
    locals_ = [hand_inner_steps(cfg, trainer, r, 2) for r in range(2)]
    for i, theta in enumerate(theta0):
        delta = ((theta - locals_[0][i]) + (theta - locals_[1][i])) / 2
        # First outer step: b = delta; Nesterov u = delta + m b = (1 + m) delta.
        expected = theta - 0.7 * (1 + 0.6) * delta
        assert torch.allclose(trainer.outer.params[i], expected, atol=1e-6)


def test_replicas_restart_identical_and_keep_their_inner_state(tiny):
    trainer = Trainer(
        load_config(None, [*tiny, "workers=4", "train.batch_tokens=512", "inner.optimizer=adamw"])
    )
    trainer.run()
    for replica in trainer.replicas:
        for p, g in zip(replica.model.parameters(), trainer.outer.params, strict=True):
            assert torch.equal(p, g)
        # AdamW's step counter counts every inner step of the run: state persisted across rounds.
        state = next(iter(replica.optimizer.optimizers[0].state.values()))
        assert int(state["step"]) == trainer.total_steps
    # Replicas read disjoint data: chunk ids of their streams never coincide within an epoch.
    seen = [set(r.stream.chunk_ids(0, r.stream.position).tolist()) for r in trainer.replicas]
    assert all(not (seen[i] & seen[j]) for i in range(4) for j in range(i + 1, 4))


class _Interleave:
    """One stream that yields micro-batch i from stream i mod K: a single worker seeing DP's data."""

    def __init__(self, streams):
        self.streams, self.calls = streams, 0

    def next_batch(self, n):
        stream = self.streams[self.calls % len(self.streams)]
        self.calls += 1
        return stream.next_batch(n)

    def state_dict(self):
        return {}


def test_dp_with_k_workers_equals_one_worker_with_the_k_times_batch(tiny):
    dp = Trainer(load_config(None, [*tiny, "method=dp", "workers=2", "train.batch_tokens=512", "run.name=a"]))
    dp.run()
    single = Trainer(
        load_config(
            None,
            [
                *tiny,
                "method=dp",
                "workers=1",
                "train.batch_tokens=512",
                "train.micro_batch_tokens=256",
                "run.name=b",
            ],
        )
    )
    single.dp_streams = [_Interleave([copy.deepcopy(s) for s in dp_streams_at_start(dp)])]
    single.run()
    for a, b in zip(params_of(dp.replicas[0].model), params_of(single.replicas[0].model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def dp_streams_at_start(trainer):
    return [
        ReplicaStream(
            trainer.data.train, trainer.cfg.model.seq_len, r, trainer.cfg.workers, trainer.cfg.run.seed
        )
        for r in range(trainer.cfg.workers)
    ]


def test_python_api_reproduces_the_engine(tiny):
    cfg = load_config(None, [*tiny, "workers=1", "sync.every=3", "inner.optimizer=muon"])
    trainer = Trainer(cfg)
    trainer.run()

    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, 256)
    opt = build_inner_optimizer(model, cfg.inner)
    diloco = DiLoCo(model, opt, sync_every=3, outer_lr=cfg.outer.lr, outer_momentum=cfg.outer.momentum)
    stream = ReplicaStream(trainer.data.train, cfg.model.seq_len, 0, 1, cfg.run.seed)
    t = cfg.train
    for step in range(cfg.total_steps):
        set_lr_multiplier(
            opt, lr_multiplier(step, cfg.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)
        )
        x, y = stream.next_batch(cfg.worker_batch_tokens // cfg.model.seq_len)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        diloco.step()
    assert diloco.outer_steps == trainer.outer_steps == 4
    for a, b in zip(params_of(model), trainer.outer.params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
