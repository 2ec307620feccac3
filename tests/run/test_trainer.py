"""The training loop: learning, resume, the run-directory contract, DiLoCo's reduction to plain training."""

import json
import shutil

import pytest
import torch

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.errors import CheckpointError, UserError
from muloco.run.trainer import Trainer

SUMMARY_KEYS = {
    "run_name",
    "method",
    "inner_optimizer",
    "workers",
    "sync_every",
    "bits",
    "final_val_loss",
    "tokens_seen",
    "inner_steps",
    "outer_steps",
    "bytes_sent_per_worker",
    "bytes_ddp_equivalent",
    "wall_time_s",
    "tokens_per_s",
    "status",
}


def run(overrides):
    trainer = Trainer(load_config(None, overrides))
    return trainer, trainer.run()


def final_params(trainer):
    return [p.detach().clone() for p in trainer.replicas[0].model.parameters()]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_few_steps_lower_the_loss(tiny, optimizer):
    _, summary = run([*tiny, "method=dp", f"inner.optimizer={optimizer}", "train.total_tokens=6144"])
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5


def test_run_directory_contract(tiny, tmp_path):
    trainer, summary = run([*tiny, "workers=2", "train.batch_tokens=512"])
    run_dir = trainer.run_dir
    assert (run_dir / "config.yaml").is_file() and list_checkpoints(run_dir / "checkpoints")
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(on_disk) and on_disk["status"] == "completed"
    assert on_disk["tokens_seen"] == 3072 and on_disk["inner_steps"] == 6 and on_disk["outer_steps"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"eval", "sync"}
    for r in records:
        assert {"kind", "step", "tokens", "time_s"} <= set(r)
    syncs = [r for r in records if r["kind"] == "sync"]
    assert all("train_loss" in r and "bytes_sent" in r and -1 <= r["pseudograd_cosine"] <= 1 for r in syncs)
    # fp32 ring all-reduce of the pseudogradient once per sync; DDP-equivalent once per inner step (H = 3).
    assert on_disk["bytes_ddp_equivalent"] == pytest.approx(3 * on_disk["bytes_sent_per_worker"])


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tiny, tmp_path):
    overrides = [*tiny, "workers=2", "train.batch_tokens=512", "checkpoint.every=1", "checkpoint.keep=10"]
    full, _ = run(overrides)
    expected = final_params(full)
    # Pretend the run died after its first outer step: drop the later checkpoints and resume.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, summary = run([*overrides, f"run.output_dir={resumed_dir}"])
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step_00000003.pt"
    assert summary["outer_steps"] == 2 and summary["status"] == "completed"
    for a, b in zip(expected, final_params(resumed), strict=True):
        assert torch.equal(a, b)
    steps = [
        json.loads(line)["step"] for line in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == sorted(steps)  # the interrupted run's later records were dropped, not duplicated


def test_dp_resume_is_bitwise_identical(tiny, tmp_path):
    overrides = [*tiny, "method=dp", "checkpoint.every=2", "checkpoint.keep=10"]
    full, _ = run(overrides)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, _ = run([*overrides, f"run.output_dir={resumed_dir}"])
    for a, b in zip(final_params(full), final_params(resumed), strict=True):
        assert torch.equal(a, b)


def test_diloco_with_one_worker_h1_lr1_momentum0_equals_plain_training(tiny):
    common = [*tiny, "inner.optimizer=adamw", "workers=1"]
    plain, _ = run([*common, "method=dp", "run.name=plain"])
    diloco, _ = run(
        [*common, "method=diloco", "sync.every=1", "outer.lr=1", "outer.momentum=0", "run.name=dl"]
    )
    for a, b in zip(final_params(plain), final_params(diloco), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_corrupt_newest_checkpoint_falls_back_and_all_corrupt_is_an_error(tiny, tmp_path):
    overrides = [*tiny, "checkpoint.every=1", "checkpoint.keep=3"]
    first, _ = run(overrides)
    ckpts = list_checkpoints(first.run_dir / "checkpoints")
    ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:100])  # torn file
    second = Trainer(load_config(None, overrides))
    assert second.resumed_from == ckpts[-2]
    for path in ckpts:
        path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        Trainer(load_config(None, overrides))


def test_checkpoint_of_another_config_is_refused(tiny):
    first, _ = run(tiny)
    with pytest.raises(CheckpointError, match="different config"):
        Trainer(load_config(None, [*tiny, "inner.lr=0.01"]))
    assert load_checkpoint(list_checkpoints(first.run_dir / "checkpoints")[-1])["progress"]["steps"] == 12


def test_unwritable_output_dir_is_a_user_error(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="run.output_dir"):
        Trainer(load_config(None, [*tiny, f"run.output_dir={blocker}"]))


def test_wandb_offline_run_lives_in_the_run_dir(tiny):
    trainer, summary = run([*tiny, "logging.wandb=true", "method=dp"])
    assert summary["status"] == "completed"
    assert (trainer.run_dir / "wandb").is_dir()


def test_offload_options_run_and_change_nothing_on_cpu(tiny):
    base, _ = run([*tiny, "workers=2", "train.batch_tokens=512", "run.name=base"])
    off, summary = run(
        [
            *tiny,
            "workers=2",
            "train.batch_tokens=512",
            "outer.offload=cpu",
            "simulation.offload=true",
            "run.name=off",
        ]
    )
    assert off.engine.outer.device.type == "cpu" and summary["status"] == "completed"
    for a, b in zip(base.engine.outer.params, off.engine.outer.params, strict=True):
        assert torch.equal(a, b)
