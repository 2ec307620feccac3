"""The inner-optimizer factory: all four options train a tiny GPT; the wrapper's contract for the trainer."""

import copy

import pytest
import torch

from muloco.config import InnerConfig
from muloco.models import GPT, GPTConfig
from muloco.optim import InnerOptimizer, Muon, build_inner_optimizer

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
OPTIONS = {
    "muon": {},
    "adamw": {},
    "sgd": {"lr": 0.1},
    "torch_muon": {"adjust_lr": "original"},
}


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(TINY)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def train(model, opt, steps, seed=0):
    losses = []
    for step in range(steps):
        x, y = batch(seed + step % 2)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", OPTIONS)
def test_each_option_reduces_the_loss_of_a_tiny_gpt(kind):
    model = tiny_gpt()
    opt = build_inner_optimizer(model, InnerConfig(optimizer=kind, **OPTIONS[kind]))
    x, y = batch()
    before = model(x, y).item()
    train(model, opt, 5)
    assert model(x, y).item() < before - 0.05, kind


def test_muon_option_wires_muon_and_adamw_from_the_config():
    inner = InnerConfig(
        lr=0.03, momentum=0.9, nesterov=False, ns_steps=4, ns_coefficients="polar_express",
        adjust_lr="match_rms_adamw", weight_decay=0.01,
        adamw={"lr": 0.002, "betas": (0.8, 0.9), "eps": 1e-9, "weight_decay": 0.05},
    )  # fmt: skip
    opt = build_inner_optimizer(tiny_gpt(), inner)
    muon, adamw = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    m, a = muon.param_groups[0], adamw.param_groups[0]
    assert (m["lr"], m["momentum"], m["nesterov"], m["ns_steps"]) == (0.03, 0.9, False, 4)
    assert (m["ns_coefficients"], m["adjust_lr"], m["weight_decay"]) == (
        "polar_express",
        "match_rms_adamw",
        0.01,
    )
    assert (a["lr"], a["betas"], a["eps"], a["weight_decay"]) == (0.002, (0.8, 0.9), 1e-9, 0.05)
    assert len(m["params"]) == 4 * TINY.n_layers
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw"]


def test_param_groups_carry_initial_lr_and_the_trainer_can_scale_them():
    model = tiny_gpt()
    opt = build_inner_optimizer(model, InnerConfig())
    assert [g["initial_lr"] for g in opt.param_groups] == [0.02, 0.003]
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * 0.0  # what the trainer's schedule does, here with 0
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("kind", OPTIONS)
def test_state_dict_round_trip(kind):
    model = tiny_gpt()
    inner = InnerConfig(optimizer=kind, **OPTIONS[kind])
    opt = build_inner_optimizer(model, inner)
    train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 3, seed=1)

    resumed = tiny_gpt(seed=123)
    resumed.load_state_dict(saved_model)
    fresh = build_inner_optimizer(resumed, inner)
    fresh.load_state_dict(saved_opt)
    train(resumed, fresh, 3, seed=1)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_bytes_muon_holds_one_buffer_adamw_two():
    model = tiny_gpt()
    opt = build_inner_optimizer(model, InnerConfig())
    train(model, opt, 1)
    muon, adamw = opt.optimizers
    muon_numel = sum(p.numel() for p in muon.param_groups[0]["params"])
    adamw_params = adamw.param_groups[0]["params"]
    steps = sum(adamw.state[p]["step"].numel() * adamw.state[p]["step"].element_size() for p in adamw_params)
    assert opt.state_bytes() == 4 * muon_numel + 2 * 4 * sum(p.numel() for p in adamw_params) + steps


def test_describe_is_the_routing_table():
    text = build_inner_optimizer(tiny_gpt(), InnerConfig()).describe()
    assert text.splitlines()[1].split()[:2] == ["muon", str(4 * TINY.n_layers)]
    assert "adamw" in text.splitlines()[2]
    assert (
        build_inner_optimizer(tiny_gpt(), InnerConfig(optimizer="adamw"))
        .describe()
        .splitlines()[1]
        .startswith("adamw")
    )


def test_torch_muon_rejects_what_torch_cannot_do():
    with pytest.raises(ValueError, match="inner.adjust_lr"):
        build_inner_optimizer(tiny_gpt(), InnerConfig(optimizer="torch_muon", adjust_lr="spectral"))
    with pytest.raises(ValueError, match="inner.ns_coefficients"):
        build_inner_optimizer(
            tiny_gpt(), InnerConfig(optimizer="torch_muon", adjust_lr="original", ns_coefficients="muloco")
        )


def test_routing_overrides_reach_the_factory():
    inner = InnerConfig(adamw_params=[r"mlp\.fc"])
    opt = build_inner_optimizer(tiny_gpt(), inner)
    assert len(opt.optimizers[0].param_groups[0]["params"]) == 3 * TINY.n_layers
    with pytest.raises(ValueError, match="inner.muon_params"):
        build_inner_optimizer(tiny_gpt(), InnerConfig(muon_params=["nothing_like_this"]))


def test_load_state_dict_refuses_a_different_layout():
    opt = build_inner_optimizer(tiny_gpt(), InnerConfig())
    other = build_inner_optimizer(tiny_gpt(), InnerConfig(optimizer="adamw"))
    with pytest.raises(ValueError, match="inner.optimizer"):
        opt.load_state_dict(other.state_dict())
    assert isinstance(opt, InnerOptimizer)
