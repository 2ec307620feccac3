"""muloco/models/norms.py: the built-in GPT's LayerNorm, nn.LayerNorm's outputs with gradients that are the
same bits at any torch thread count (torch's own CPU layer_norm backward sums per-thread partials)."""

import json
from pathlib import Path

import pytest
import torch
from test_helpers import final_global_params, run_muloco
from torch import nn

from muloco.config import ModelConfig, load_config
from muloco.models import ParamRole, build_model
from muloco.models.norms import LayerNorm
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")
ROWS = (16, 128)  # (B, T): the quickstart's 16 sequences of 128 tokens per worker and step


def grads(norm: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """[y, dx, dweight(, dbias)] of one forward and backward."""
    norm.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = norm(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in norm.parameters())]


def pair(dim: int, bias: bool) -> tuple[LayerNorm, nn.LayerNorm]:
    """Ours and torch's, with the same weights away from 1 (and biases away from 0)."""
    ours, theirs = LayerNorm(dim, bias=bias), nn.LayerNorm(dim, bias=bias)
    with torch.no_grad():
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            b.copy_(a.normal_(0.5, 1.0))
    return ours, theirs


def inputs(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dim)
    return torch.randn(*ROWS, dim, generator=g) * 3 + 1, torch.randn(*ROWS, dim, generator=g)


@pytest.mark.parametrize("dim, bias", [(64, False), (128, False), (384, False), (768, False), (128, True)])
def test_gradients_are_the_same_bits_at_1_2_and_4_threads(dim, bias):
    ours, theirs = pair(dim, bias)
    x, dy = inputs(dim)
    saved = torch.get_num_threads()
    try:
        runs = {}
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            runs[threads] = grads(ours, x, dy), grads(theirs, x, dy)
    finally:
        torch.set_num_threads(saved)
    for threads in (2, 4):
        for a, b in zip(runs[1][0], runs[threads][0], strict=True):
            assert torch.equal(a, b), (threads, (a - b).abs().max())
    # torch's own weight gradient is what moved (the premise): its per-thread partials at 1 and 2 threads.
    assert not torch.equal(runs[1][1][2], runs[2][1][2])


@pytest.mark.parametrize("dim, bias", [(64, False), (768, False), (128, True)])
def test_outputs_and_input_gradients_are_nn_layernorms_and_the_parameter_gradients_within_rounding(dim, bias):
    ours, theirs = pair(dim, bias)
    x, dy = inputs(dim)
    (y, dx, *dparams), (y_ref, dx_ref, *dparams_ref) = grads(ours, x, dy), grads(theirs, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)  # the same kernels
    with torch.no_grad():
        assert torch.equal(ours(x), y_ref)  # without grad: F.layer_norm itself
    for a, b in zip(dparams, dparams_ref, strict=True):  # sums of 2048 terms in another order
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max() / b.abs().max()


def test_the_gpt_uses_it_with_nn_layernorms_parameters_keys_and_roles():
    model = build_model(ModelConfig(preset="nano", norm="layernorm"), 256)
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 4 + 1 and all(type(m) is LayerNorm for m in norms)
    assert list(model.final_norm.state_dict()) == ["weight"]  # no bias, as before: checkpoints load
    model.final_norm.load_state_dict(nn.LayerNorm(128, bias=False).state_dict())
    roles = model.param_roles()
    assert all(roles[n] is ParamRole.NORM for n in model.state_dict() if "norm" in n)
    assert type(build_model(ModelConfig(preset="nano", norm="rmsnorm"), 256).final_norm) is nn.RMSNorm


# Time (~25 s on 2 cores): the quickstart at workers=2 simulated in this process at 2 threads, and over 2
# processes at 1 thread each. Before norms.py (nn.LayerNorm) their val losses parted at the first step.
@pytest.mark.slow(seconds=25)
def test_the_quickstart_at_2_simulated_workers_equals_2_processes_bit_for_bit(tmp_path):
    common = [
        "workers=2",
        "train.total_tokens=24576",  # 6 steps of 4096 tokens, 2 outer steps (H = 3)
        "sync.every=3",
        "train.eval_every=0",
        "train.eval_tokens=4096",
        "logging.progress=off",
        f"run.output_dir={tmp_path}",
    ]
    sim = Trainer(load_config(QS, [*common, "train.threads=2", "run.name=sim"]))
    simulated = sim.run()
    result = run_muloco("launch", "--nproc", 2, QS, *common, "train.threads=1", "run.name=p2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    processes = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert processes["workers"] == simulated["workers"] == 2 and processes["outer_steps"] == 2
    assert processes["final_val_loss"] == simulated["final_val_loss"]
    for a, b in zip(final_global_params(sim.run_dir), final_global_params(tmp_path / "p2"), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
