"""simulation.batched (muloco/run/batched.py): the replicas of a process stepped together equal the same
replicas stepped one after another, and their checkpoints are interchangeable."""

import shutil

import pytest
import torch

from muloco.checkpoint.plain import list_checkpoints
from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.optim import Muon
from muloco.run.batched import merge_optimizers, step_together
from muloco.run.trainer import Trainer


def run(overrides):
    trainer = Trainer(load_config(None, overrides))
    return trainer, trainer.run()


def state_tensors(trainer):
    """Every replica's parameters and inner optimizer state tensors, in a fixed order."""
    out = []
    for replica in trainer.replicas:
        out += [p.detach() for p in replica.model.parameters()]
        for optimizer in replica.optimizer.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = optimizer.state[p]
                    out += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
    return out


def assert_same(a, b, rtol):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("optimizer", ["muon", "adamw", "sgd"])
def test_batched_equals_sequential_in_fp32(tiny, optimizer):
    common = [*tiny, "workers=4", "train.batch_tokens=512", f"inner.optimizer={optimizer}"]
    common += ["inner.ns_dtype=fp32", "inner.momentum=0.9"]
    sequential, _ = run([*common, "simulation.batched=false", "run.name=seq"])
    batched, summary = run([*common, "simulation.batched=true", "run.name=bat"])
    assert sequential.batched is False and batched.batched is True
    assert summary["status"] == "completed" and summary["outer_steps"] == 2
    assert_same(sequential.engine.global_params, batched.engine.global_params, rtol=1e-6)
    assert_same(state_tensors(sequential), state_tensors(batched), rtol=1e-6)


def test_batched_muon_in_bf16_stays_in_the_bf16_band(tiny):
    common = [*tiny, "workers=4", "train.batch_tokens=512", "inner.ns_dtype=bf16"]
    sequential, _ = run([*common, "simulation.batched=false", "run.name=seq"])
    batched, _ = run([*common, "simulation.batched=true", "run.name=bat"])
    # The same bf16 Newton-Schulz per matrix, in a bigger stack: equal, or within bf16's rounding.
    assert_same(sequential.engine.global_params, batched.engine.global_params, rtol=1e-2)


@pytest.mark.parametrize("saved_with, resumed_with", [("false", "true"), ("true", "false")])
def test_checkpoints_are_interchangeable(tiny, tmp_path, saved_with, resumed_with):
    overrides = [*tiny, "workers=2", "train.batch_tokens=512", "checkpoint.every=1", "checkpoint.keep=10"]
    overrides += ["inner.ns_dtype=fp32"]
    full, _ = run([*overrides, f"simulation.batched={saved_with}"])
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, summary = run(
        [*overrides, f"simulation.batched={resumed_with}", f"run.output_dir={resumed_dir}"]
    )
    assert resumed.resumed_from is not None and summary["outer_steps"] == 2
    assert_same(state_tensors(full), state_tensors(resumed), rtol=1e-6)


def test_replicas_left_apart_catch_up_then_step_together(tiny):
    """After an interrupted segment replica 0 is ahead: the others step alone until they meet it."""
    common = [*tiny, "workers=3", "train.batch_tokens=768", "inner.ns_dtype=fp32", "sync.every=4"]
    trainers = {}
    for batched in ("false", "true"):
        trainer = Trainer(load_config(None, [*common, f"simulation.batched={batched}"]))
        ahead = trainer.replicas[0]
        for _ in range(2):  # replica 0 finished two steps of the segment before the interrupt
            ahead.train_step(trainer.micro_batches, trainer.seqs_per_micro, 1.0, 0.0, trainer.autocast)
            ahead.inner_steps += 1
        trainer.inner.run_until(4)
        assert [r.inner_steps for r in trainer.replicas] == [4, 4, 4]
        trainers[batched] = trainer
    assert_same(state_tensors(trainers["false"]), state_tensors(trainers["true"]), rtol=1e-6)


def _muon_replicas(n, lr=0.02):
    torch.manual_seed(0)
    replicas = []
    for _ in range(n):
        params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6, 6))]
        replicas.append((params, Muon(params, lr=lr, ns_dtype=torch.float32)))
    return replicas


def test_merged_muon_step_is_each_replicas_step_and_state_stays_with_the_replica():
    together, alone = _muon_replicas(3), _muon_replicas(3)
    for step in range(3):
        grads = [[torch.randn_like(p) for p in params] for params, _ in together]
        for (params, _), (params2, _), g in zip(together, alone, grads, strict=True):
            for p, p2, gi in zip(params, params2, g, strict=True):
                p.grad, p2.grad = gi.clone(), gi.clone()
        if step == 1:  # a replica reset after a non-finite loss: its state is fresh in the merged step too
            together[1][1].state.clear()
            alone[1][1].state.clear()
        step_together([opt for _, opt in together])
        for _, opt in alone:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (params, opt), (params2, opt2) in zip(together, alone, strict=True):
        assert all(p.grad is None for p in params)
        for p, p2 in zip(params, params2, strict=True):
            assert torch.equal(p, p2)
            assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])


def test_optimizers_that_differ_are_not_merged():
    (params_a, a), (params_b, b) = _muon_replicas(2)
    assert merge_optimizers([a, b]) is not None
    b.param_groups[0]["lr"] = 0.5  # replicas at different steps of the schedule
    assert merge_optimizers([a, b]) is None
    sgd = torch.optim.SGD(params_b, lr=0.02)
    assert merge_optimizers([a, sgd]) is None


def test_batched_true_with_offload_or_several_ranks_is_a_config_error(tiny):
    for extra in (["simulation.offload=true"], ["ranks_per_worker=2", "train.micro_batch_tokens=128"]):
        with pytest.raises(ConfigError, match="simulation.batched=true .* set simulation.batched=auto"):
            load_config(
                None, [*tiny, "workers=2", "train.batch_tokens=512", "simulation.batched=true", *extra]
            )


def test_auto_batches_only_several_replicas(tiny):
    one = Trainer(load_config(None, [*tiny, "workers=1"]))
    two = Trainer(load_config(None, [*tiny, "workers=2", "train.batch_tokens=512"]))
    assert one.batched is False and two.batched is True
