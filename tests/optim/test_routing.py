"""Routing: hidden matrices on Muon, the rest on AdamW, and the regex overrides' errors."""

import re

import pytest
import torch
from torch import nn

from muloco.config import ModelConfig
from muloco.models import build_model
from muloco.optim import muon_param_groups, routing_table


@pytest.fixture(scope="module")
def micro():
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="micro"), 256)  # 4 blocks x (qkv, proj, fc, mlp.proj)


def names(named):
    return [name for name, _ in named]


def test_builtin_gpt_routes_its_16_matrices_to_muon(micro):
    muon, adamw = muon_param_groups(micro)
    assert len(muon) == 16
    assert all(name.startswith("blocks.") and p.ndim == 2 for name, p in muon)
    assert {"tok_emb.weight", "pos_emb.weight", "head.weight"} <= set(names(adamw))
    assert all(("norm" in n or "emb" in n or n.startswith("head")) for n in names(adamw))
    assert len(muon) + len(adamw) == len(list(micro.parameters()))


def test_adamw_override_wins_and_muon_override_adds(micro):
    muon, adamw = muon_param_groups(micro, muon_params=[r"^head\.", r"mlp\.fc"], adamw_params=[r"mlp\.fc"])
    assert "head.weight" in names(muon)
    assert not any("mlp.fc" in n for n in names(muon))
    assert sum("mlp.fc" in n for n in names(adamw)) == 4


def test_forcing_a_vector_onto_muon_names_field_and_parameter(micro):
    with pytest.raises(ValueError, match=r"inner\.muon_params.*'final_norm\.weight'"):
        muon_param_groups(micro, muon_params=["final_norm"])


@pytest.mark.parametrize("field", ["muon_params", "adamw_params"])
def test_a_pattern_that_matches_nothing_is_an_error(micro, field):
    message = f"inner.{field}: pattern 'attn\\.nope' matched no parameters"
    with pytest.raises(ValueError, match=re.escape(message)):
        muon_param_groups(micro, **{field: [r"attn\.nope"]})


def test_an_invalid_regex_is_an_error(micro):
    with pytest.raises(ValueError, match=r"inner\.adamw_params: pattern '\(' is not a valid regex"):
        muon_param_groups(micro, adamw_params=["("])


def test_any_module_by_inferred_roles():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 10),  # the last Linear: the head
    )
    model[0].bias.requires_grad_(False)  # frozen: left out
    muon, adamw = muon_param_groups(model)
    assert names(muon) == ["0.weight", "3.weight"]
    assert set(names(adamw)) == {"1.weight", "1.bias", "3.bias", "4.weight", "4.bias", "5.weight", "5.bias"}


def test_routing_table_counts(micro):
    table = routing_table(micro)
    muon, adamw = muon_param_groups(micro)
    lines = table.splitlines()
    assert lines[1].split()[:3] == ["muon", "16", f"{sum(p.numel() for _, p in muon):,}"]
    assert lines[2].split()[:2] == ["adamw", str(len(adamw))]
    assert "matrix x16" in lines[1] and "embedding x2" in lines[2] and "head x1" in lines[2]
