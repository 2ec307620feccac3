"""model.hf: Hugging Face causal LMs built from a config, offline; Muon routing for GPT-2 and Llama."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from muloco.config import InnerConfig, ModelConfig  # noqa: E402
from muloco.errors import ConfigError  # noqa: E402
from muloco.models import ParamRole, build_model, param_roles, transposed_weights  # noqa: E402
from muloco.optim import build_inner_optimizer  # noqa: E402
from muloco.optim.muon import Muon  # noqa: E402
from muloco.optim.routing import muon_param_groups  # noqa: E402

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4}
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
}


def _build(hf, vocab=300, seq_len=32, seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(hf=hf, seq_len=seq_len), vocab)


def test_gpt2_routing_tied_embedding_once_on_adamw_and_conv1d_on_muon():
    model = _build(GPT2)
    net = model.net
    assert net.config.vocab_size == 300 and net.config.n_positions == 32  # from the data and seq_len
    assert net.lm_head.weight is net.transformer.wte.weight  # GPT-2 ties them
    roles = param_roles(model)
    assert roles["net.transformer.wte.weight"] is ParamRole.EMBEDDING
    assert roles["net.transformer.wpe.weight"] is ParamRole.EMBEDDING
    assert "net.lm_head.weight" not in roles  # one parameter, one name
    muon, adamw = muon_param_groups(model)
    assert sorted({n.split(".")[-2] for n, _ in muon}) == ["c_attn", "c_fc", "c_proj"]
    assert [id(p) for _, p in adamw].count(id(net.transformer.wte.weight)) == 1
    assert {ParamRole.BIAS, ParamRole.NORM} <= {roles[n] for n, _ in adamw}
    assert transposed_weights(model) == {n for n, _ in muon}  # every Conv1D weight is stored (in, out)


def test_llama_routing_untied_head_norms_and_rotary_buffers():
    model = _build(LLAMA)
    roles = param_roles(model)
    assert roles["net.lm_head.weight"] is ParamRole.HEAD
    assert roles["net.model.embed_tokens.weight"] is ParamRole.EMBEDDING
    assert roles["net.model.norm.weight"] is ParamRole.NORM
    muon, _ = muon_param_groups(model)
    assert len(muon) == 2 * 7 and all(roles[n] is ParamRole.MATRIX for n, _ in muon)
    assert not any("rotary" in n for n, _ in model.named_parameters())  # buffers, never parameters
    assert transposed_weights(model) == set()


def test_a_muon_step_on_gpt2_conv1d_equals_the_step_on_the_same_weight_as_linear():
    """The inner optimizer built for GPT-2 steps Conv1D (in, out) weights as nn.Linear (out, in) ones."""
    model = _build(GPT2)
    inner = InnerConfig(optimizer="muon", ns_dtype="fp32")
    optimizer = build_inner_optimizer(model, inner)
    conv = model.net.transformer.h[0].mlp.c_fc  # weight (32, 128) = (in, out)
    linear = torch.nn.Linear(32, 128, bias=False)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.mT)
    reference = Muon([linear.weight], lr=inner.lr, momentum=inner.momentum, ns_dtype=torch.float32)
    x = torch.randint(0, 300, (2, 32))
    for _ in range(3):
        optimizer.zero_grad()
        model(x, x).backward()
        linear.weight.grad = conv.weight.grad.mT.clone()
        optimizer.step()
        reference.step()
        torch.testing.assert_close(conv.weight.detach().mT, linear.weight.detach(), rtol=1e-5, atol=1e-6)


def test_torch_muon_refuses_transposed_weights():
    with pytest.raises(ConfigError, match="transposed"):
        build_inner_optimizer(_build(GPT2), InnerConfig(optimizer="torch_muon", adjust_lr="original"))


def test_init_is_seeded_and_the_loss_starts_near_uniform():
    a, b = _build(LLAMA, seed=3), _build(LLAMA, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    x = torch.randint(0, 300, (2, 32))
    assert abs(a(x, x).item() - torch.log(torch.tensor(300.0)).item()) < 0.5


def test_a_local_config_json_with_overrides(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["LlamaForCausalLM"]}))
    model = _build(str(tmp_path))  # a directory holding config.json
    assert model.net.config.hidden_size == 32
    model = _build({"config": str(tmp_path / "config.json"), "num_hidden_layers": 1})
    assert model.net.config.num_hidden_layers == 1 and len(model.net.model.layers) == 1


def test_an_explicit_context_length_is_kept_under_either_name():
    assert _build({**GPT2, "n_positions": 64}).net.config.n_positions == 64
    assert _build({**GPT2, "max_position_embeddings": 48}).net.config.n_positions == 48  # GPT-2's alias
    assert _build({**LLAMA, "max_position_embeddings": 40}).net.config.max_position_embeddings == 40


@pytest.mark.parametrize(
    "hf, needles",
    [
        ({"hidden_size": 8}, ["model.hf", "model_type"]),
        ({"model_type": "lama"}, ["model.hf.model_type", "llama"]),
        ({**LLAMA, "hiden_size": 8}, ["model.hf.hiden_size", "hidden_size"]),
        ({**LLAMA, "vocab_size": 100}, ["model.hf", "300"]),
        ("/nonexistent/config.json", ["model.hf", "cannot read"]),
        ({**LLAMA, "hidden_size": 30}, ["model.hf: invalid llama config", "multiple of"]),
        ({**GPT2, "n_embd": 30}, ["model.hf: cannot build gpt2", "divisible"]),
        ({**GPT2, "n_positions": 16}, ["model.hf", "positions >= 32"]),
    ],
)
def test_bad_hf_configs_are_one_line_errors(hf, needles):
    with pytest.raises(ConfigError) as info:
        _build(hf)
    assert "\n" not in str(info.value) and all(n in str(info.value) for n in needles), str(info.value)
