"""`muloco.DiLoCo` (diloco.py): the Python API on the same sync engine as `muloco train`: the same global
parameters bit for bit, streaming, compression with its error feedback in `state_dict`, the guard."""

import math

import pytest
import torch
from test_helpers import params_of

from muloco import DiLoCo
from muloco.compress import get_compressor
from muloco.config import CompressionConfig, HivemindBackendConfig, load_config
from muloco.data import ReplicaStream
from muloco.errors import TrainingError
from muloco.models import build_model
from muloco.optim import build_inner_optimizer
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.replica import set_lr_multiplier
from muloco.run.trainer import Trainer

STAT4_EF = [
    "compression.scheme=statistical",
    "compression.bits=4",
    "compression.granularity=row",
    "compression.error_feedback=true",
]
STAT = CompressionConfig(scheme="statistical")
STREAMING = ["sync.every=4", "sync.fragments=2", "sync.overlap=1", "sync.alpha=0.5"]


def user_loop(cfg, data, steps, diloco_kwargs=None, state=None):
    """`muloco train`'s inner steps, written as a user would around their own model (K = 1)."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, 256)
    opt = build_inner_optimizer(model, cfg.inner)
    diloco = DiLoCo(
        model,
        opt,
        sync_every=cfg.sync.every,
        outer_lr=cfg.outer.lr,
        outer_momentum=cfg.outer.momentum,
        compression=cfg.compression,
        fragments=cfg.sync.fragments,
        overlap=cfg.sync.overlap,
        alpha=cfg.sync.alpha,
        total_steps=cfg.total_steps,
        transport=cfg.sync.transport,
        eager=cfg.sync.eager,
        **(diloco_kwargs or {}),
    )
    stream = ReplicaStream(data.train, cfg.model.seq_len, 0, 1, cfg.run.seed)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        stream.load_state_dict(state["stream"])
        diloco.load_state_dict(state["diloco"])
    t = cfg.train
    while diloco.local_step < steps:
        step = diloco.local_step
        set_lr_multiplier(
            opt, lr_multiplier(step, cfg.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)
        )
        x, y = stream.next_batch(cfg.worker_batch_tokens // cfg.model.seq_len)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        diloco.step(loss.item())
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "stream": stream.state_dict()}
    return diloco, {**saved, "diloco": diloco.state_dict()}


@pytest.mark.parametrize(
    "extra",
    [
        ["inner.optimizer=muon"],
        ["inner.optimizer=muon", *STAT4_EF, *STREAMING],
        ["inner.optimizer=muon", *STAT4_EF, "sync.transport=reduce_scatter"],
        ["inner.optimizer=muon", *STAT4_EF, "sync.overlap=3"],
        ["inner.optimizer=muon", *STAT4_EF, "sync.overlap=3", "sync.eager=true"],
    ],
    ids=["plain", "streaming-stat4-ef", "stat4-ef-reduce-scatter", "whole-window-stat4-ef", "eager-stat4-ef"],
)
def test_diloco_equals_muloco_train_bit_for_bit(tiny, extra):
    cfg = load_config(None, [*tiny, "workers=1", "sync.every=3", *extra])
    trainer = Trainer(cfg)
    trainer.run()
    diloco, _ = user_loop(cfg, trainer.data, cfg.total_steps)
    assert diloco.outer_steps == trainer.progress.outer_steps > 0
    assert diloco.ledger.bytes_sent == trainer.ledger.bytes_sent
    for a, b in zip(diloco.global_params, trainer.engine.outer.params, strict=True):
        assert torch.equal(a, b)


def test_state_dict_holds_error_feedback_and_resume_is_exact(tiny):
    cfg = load_config(None, [*tiny, "workers=1", *STAT4_EF, *STREAMING, "inner.optimizer=adamw"])
    data = Trainer(load_config(None, [*tiny, "run.name=data"])).data
    straight, _ = user_loop(cfg, data, cfg.total_steps)
    _, saved = user_loop(cfg, data, 6)  # fragment 1 started a sync at step 6, applied at step 7
    buffers = saved["diloco"]["engine"]["error_feedback"][0]["buffers"]
    assert buffers and all(torch.count_nonzero(b) > 0 for b in buffers.values())
    assert saved["diloco"]["engine"]["in_flight"]
    resumed, _ = user_loop(cfg, data, cfg.total_steps, state=saved)
    assert resumed.outer_steps == straight.outer_steps
    for a, b in zip(straight.global_params, resumed.global_params, strict=True):
        assert torch.equal(a, b)


def test_a_non_finite_loss_leaves_the_replica_out_then_max_bad_syncs_stop():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=2, max_bad_syncs=2)
    start = params_of(model)
    with torch.no_grad():
        model.weight.fill_(math.nan)  # what a diverged inner step leaves behind
    diloco.step(float("nan"))
    assert diloco.step(float("nan"))  # the sync: this replica left out, K = 1 so no outer step
    assert diloco.records[0].fields["replicas_left_out"] == 1 and diloco.progress.bad_syncs == 1
    assert all(torch.equal(a, b) for a, b in zip(start, params_of(model), strict=True))  # reset
    assert not opt.state or all(not s for s in opt.state.values())
    diloco.step(float("inf"))
    with pytest.raises(TrainingError, match="max_bad_syncs = 2"):
        diloco.step()


def test_a_compressor_object_compresses_every_parameter():
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=1, compression=get_compressor("linear", bits=8))
    before = params_of(model)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    assert diloco.step() and diloco.outer_steps == 1
    assert diloco.records[0].fields["bits_per_param"] < 32 / 2
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True))


def test_a_forced_sync_applies_everything_in_flight():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=4, fragments=2, overlap=1, compression=CompressionConfig())
    assert [f.indices for f in diloco.engine.fragments] == [
        [0, 1],
        [2, 3],
    ]  # nn.Sequential's "0." and "1." are its blocks
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    diloco.step()
    diloco.step()  # step 2: fragment 1 starts, applied at step 3
    assert len(diloco.engine.in_flight) == 1
    diloco.sync()
    assert not diloco.engine.in_flight and diloco.progress.fragment_syncs == 3
    for p, g in zip(model.parameters(), diloco.global_params, strict=True):
        assert torch.equal(p, g)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_every": 0}, "sync_every must be an integer >= 1"),
        ({"sync_every": 4, "fragments": 5}, "sync.fragments \\(5\\) exceeds sync.every \\(4\\)"),
        ({"sync_every": 4, "outer_momentum": 1.0}, "DiLoCo\\(momentum=...\\)"),
        ({"sync_every": 4, "alpha": 2.0}, "DiLoCo\\(alpha=...\\)"),
        ({"sync_every": 4, "backend": "torch"}, "backend must be None"),
        ({"sync_every": 4, "compression": "stat4"}, "compression must be"),
        ({"sync_every": 4, "transport": "ring"}, "DiLoCo\\(transport=...\\)"),
        ({"sync_every": 4, "aggregate": "krum"}, "DiLoCo\\(aggregate=...\\)"),
        ({"sync_every": 4, "aggregate": "median", "trim": 0}, "DiLoCo\\(trim=...\\)"),
        (
            {
                "sync_every": 4,
                "transport": "reduce_scatter",
                "backend": HivemindBackendConfig(),
                "compression": STAT,
            },
            "DiLoCo\\(transport='reduce_scatter'\\): .* needs backend.kind local or torch",
        ),
        (
            {"sync_every": 4, "overlap": 4, "backend": HivemindBackendConfig()},
            "DiLoCo\\(overlap=4\\): sync.overlap=4 \\(a whole window\\)",
        ),
        (
            {"sync_every": 4, "fragments": 2},
            "DiLoCo\\(fragments=2\\): sync.fragments \\(2\\) exceeds the model's 0 blocks",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def test_a_tensor_loss_that_is_not_finite_is_read_once_per_sync():
    model = torch.nn.Linear(4, 2)
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    diloco.step(torch.tensor(float("nan")))  # kept on its device until the sync
    assert diloco.replica.healthy and not diloco.records
    assert diloco.step(torch.tensor(1.0))
    assert diloco.records[0].fields["replicas_left_out"] == 1 and diloco.replica.healthy  # reset


def test_state_of_another_format_or_a_late_load_is_refused():
    model = torch.nn.Linear(4, 2)
    diloco = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    with pytest.raises(
        ValueError, match=r"a state of format 1 \(muloco <= 0.1\), this muloco reads format 2"
    ):
        diloco.load_state_dict({"outer": {}, "local_step": 3, "outer_steps": 1})
    state = diloco.state_dict()
    diloco.step()
    with pytest.raises(RuntimeError, match="before the first step"):
        diloco.load_state_dict(state)


def test_a_forced_sync_with_a_short_overlap_counts_each_step_once():
    """tau < H: the replicas train on from their own parameters after a start, so the sync in flight is
    applied before the forced one starts (its drift is not sent twice). One worker, outer lr 1, no
    momentum: the global parameters end where the model is."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = DiLoCo(model, opt, sync_every=2, overlap=1, outer_lr=1.0, outer_momentum=0.0)
    for _ in range(2):
        model(torch.randn(4, 2)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        diloco.step()
    local = [p.detach().clone() for p in model.parameters()]
    diloco.sync()
    for g, p in zip(diloco.global_params, local, strict=True):
        torch.testing.assert_close(g, p)


def test_an_eager_state_resumes_only_into_eager():
    model = torch.nn.Linear(2, 2)
    saved = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, overlap=1, eager=True)
    plain = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, overlap=1)
    with pytest.raises(ValueError, match="saved with eager=True into DiLoCo\\(eager=False\\)"):
        plain.load_state_dict(saved.state_dict())
