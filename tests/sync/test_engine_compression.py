"""Compressed pseudogradients in the engine: what is averaged is what was sent, and bytes are measured."""

import shutil

import torch
from test_helpers import hand_inner_steps

from muloco.checkpoint.plain import list_checkpoints
from muloco.config import load_config
from muloco.models import build_model, param_roles
from muloco.run.trainer import Trainer
from muloco.sync.codec import PseudogradientCodec
from muloco.sync.outer import nesterov_outer_step

COMPRESSED = ["compression.scheme=statistical", "compression.bits=4", "compression.granularity=row"]


def test_outer_step_uses_the_mean_of_the_decoded_payloads(tiny):
    cfg = load_config(
        None,
        [
            *tiny,
            *COMPRESSED,
            "workers=2",
            "train.batch_tokens=512",
            "train.total_tokens=1024",
            "sync.every=2",
            "inner.optimizer=adamw",
        ],
    )
    trainer = Trainer(cfg)
    theta0 = [p.clone() for p in trainer.engine.outer.params]
    summary = trainer.run()
    names = [n for n, _ in trainer.replicas[0].model.named_parameters()]
    codec = PseudogradientCodec.from_config(names, param_roles(trainer.replicas[0].model), cfg.compression)
    total = [torch.zeros_like(t) for t in theta0]
    sizes = []
    for r in range(2):
        local = hand_inner_steps(cfg, trainer, r, 2)
        message = codec.encode([t - p for t, p in zip(theta0, local)])
        sizes.append(len(message))
        codec.decode_sum(message, total)
    expected = [t.clone() for t in theta0]
    nesterov_outer_step(expected, [t / 2 for t in total], [torch.zeros_like(t) for t in theta0], 0.7, 0.6)
    for a, b in zip(expected, trainer.engine.outer.params):
        assert torch.allclose(a, b, atol=1e-6)
    # K = 2: a ring all-gather sends the other node one message per sync.
    assert summary["bytes_sent_per_worker"] == sum(sizes) / 2
    assert summary["effective_bits_per_param"] < 32 / 4


def test_effective_bits_on_the_quickstart_model_stay_within_15_percent_of_nominal():
    cfg = load_config("configs/quickstart.yaml", ["compression.scheme=statistical"])
    model = build_model(cfg.model, 256)
    names = [n for n, _ in model.named_parameters()]
    params = sum(p.numel() for p in model.parameters())
    for bits in (4, 8):
        compression = cfg.compression.model_copy(update={"bits": bits})
        codec = PseudogradientCodec.from_config(names, param_roles(model), compression)
        message = codec.encode([torch.randn_like(p) for p in model.parameters()])
        assert 8 * len(message) / params <= 1.15 * bits


def test_error_feedback_state_is_checkpointed_and_resume_is_bitwise(tiny, tmp_path):
    overrides = [
        *tiny,
        *COMPRESSED,
        "compression.bits=2",
        "compression.error_feedback=true",
        "workers=2",
        "train.batch_tokens=512",
        "checkpoint.every=1",
        "checkpoint.keep=10",
    ]
    full = Trainer(load_config(None, overrides))
    full.run()
    assert all(ef.buffers for ef in full.engine.error_feedback)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed = Trainer(load_config(None, [*overrides, f"run.output_dir={resumed_dir}"]))
    resumed.run()
    for a, b in zip(full.engine.outer.params, resumed.engine.outer.params):
        assert torch.equal(a, b)
