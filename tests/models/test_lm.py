"""model.factory and the CausalLM wrapper: the logits contract, the traced head, one-line errors."""

import textwrap

import pytest
import torch
from torch import nn

from muloco.config import ModelConfig
from muloco.errors import ConfigError
from muloco.models import CausalLM, ParamRole, build_model, param_roles
from muloco.optim.routing import muon_param_groups

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        # The head is NOT the last Linear: a Linear "probe" registered after it is a hidden matrix.
        def __init__(self, vocab_size, seq_len, width=32, tied=False):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.mix = nn.Linear(width, width, bias=False)
            self.out = nn.Linear(width, vocab_size, bias=False)
            self.probe = nn.Linear(width, width, bias=True)
            if tied:
                self.out.weight = self.embed.weight
            self.seq_len = seq_len

        def forward(self, ids):
            h = torch.tanh(self.mix(self.embed(ids))) + self.probe(self.embed(ids))
            return self.out(h)  # (B, T, vocab)

    def tiny(vocab_size, seq_len, width=32, tied=False):
        return TinyLM(vocab_size, seq_len, width, tied)

    def wrong_shape(vocab_size):
        class Flat(nn.Module):
            def __init__(self):
                super().__init__()
                self.e = nn.Embedding(vocab_size, 8)
            def forward(self, ids):
                return self.e(ids).sum(1)  # (B, 8): not (B, T, vocab)
        return Flat()

    def small_vocab():
        return TinyLM(100, 16)

    def not_a_module():
        return 42

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_models"


def _build(spec, vocab=300, **kwargs):
    torch.manual_seed(0)
    return build_model(ModelConfig(factory=spec, kwargs=kwargs, seq_len=16), vocab)


def test_factory_model_trains_through_the_gpt_contract(factory_module):
    model = _build(f"{factory_module}:tiny", width=24)
    assert isinstance(model, CausalLM) and model.net.mix.in_features == 24  # kwargs reached the function
    assert model.net.seq_len == 16  # seq_len filled in from model.seq_len
    x = torch.randint(0, 300, (2, 16))
    assert model(x).shape == (2, 16, 300)
    loss = model(x, x)
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 1.0


def test_the_head_is_the_layer_that_returns_the_logits_not_the_last_linear(factory_module):
    roles = param_roles(_build(f"{factory_module}:tiny"))
    assert roles["net.out.weight"] is ParamRole.HEAD
    assert roles["net.probe.weight"] is ParamRole.MATRIX and roles["net.probe.bias"] is ParamRole.BIAS
    assert roles["net.embed.weight"] is ParamRole.EMBEDDING


def test_a_tied_head_is_one_parameter_on_adamw_once(factory_module):
    model = _build(f"{factory_module}:tiny", tied=True)
    muon, adamw = muon_param_groups(model)
    adamw_ids = [id(p) for _, p in adamw]
    assert adamw_ids.count(id(model.net.embed.weight)) == 1
    assert [n for n, _ in muon] == ["net.mix.weight", "net.probe.weight"]
    assert param_roles(model)["net.embed.weight"] is ParamRole.EMBEDDING


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("no_such_module_xyz:f", ["model.factory", "cannot import 'no_such_module_xyz'"]),
        ("{m}:missing", ["model.factory", "has no attribute 'missing'"]),
        ("{m}:NOT_CALLABLE", ["model.factory", "not a function"]),
        ("{m}:not_a_module", ["model.factory", "not a torch nn.Module"]),
        ("{m}:wrong_shape", ["model.factory", "returned (1, 8)", "logits (B, T, vocab)"]),
        ("{m}:small_vocab", ["model.factory", "vocabulary", "300"]),
    ],
)
def test_factory_errors_are_one_line_config_errors(factory_module, spec, needles):
    with pytest.raises(ConfigError) as info:
        _build(spec.format(m=factory_module))
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_bad_kwargs_name_model_kwargs(factory_module):
    with pytest.raises(ConfigError, match="model.kwargs"):
        _build(f"{factory_module}:tiny", depth=3)


def test_config_rejects_two_models_and_stray_kwargs():
    with pytest.raises(ValueError, match="model.factory and model.hf"):
        ModelConfig(factory="a:b", hf={"model_type": "llama"})
    with pytest.raises(ValueError, match="model.kwargs applies to model.factory"):
        ModelConfig(kwargs={"x": 1})
    with pytest.raises(ValueError, match="package.module:function"):
        ModelConfig(factory="just_a_module")


def test_logits_scaled_after_the_head_still_find_the_head():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.out = nn.Linear(8, 50, bias=False)

        def forward(self, ids):
            return self.out(self.embed(ids)) * 0.5  # softcapped-style: not the head layer's output

    lm = CausalLM(Scaled(), 50, 8, "model.factory")
    assert lm.head_name == "net.out"  # the layer whose output has the logits' shape
    assert param_roles(lm)["net.out.weight"] is ParamRole.HEAD


def test_several_layers_with_the_logits_shape_give_no_head_and_a_warning(caplog):
    class Square(nn.Module):  # the hidden width equals the vocabulary: shapes cannot tell the head
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 32)
            self.hidden = nn.Linear(32, 32, bias=False)
            self.out = nn.Linear(32, 32, bias=False)

        def forward(self, ids):
            return self.out(self.hidden(self.embed(ids))) * 0.5

    with caplog.at_level("WARNING", logger="muloco"):
        lm = CausalLM(Square(), 32, 8, "model.factory")
    assert lm.head_name is None and "no layer is treated as the head" in caplog.text
    roles = param_roles(lm)
    assert roles["net.hidden.weight"] is ParamRole.MATRIX and roles["net.out.weight"] is ParamRole.MATRIX


def test_a_wrapped_model_names_its_own_roles_and_transposed_weights():
    from muloco.models import transposed_weights

    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(40, 16)
            self.w = nn.Parameter(torch.randn(16, 40) * 0.02)  # (in, out): a head stored transposed

        def forward(self, ids):
            return self.embed(ids) @ self.w

        def param_roles(self):
            return {"embed.weight": ParamRole.EMBEDDING, "w": ParamRole.MATRIX}

        def transposed_weights(self):
            return {"w"}

    lm = CausalLM(Own(), 40, 8, "model.factory")
    assert param_roles(lm) == {"net.embed.weight": ParamRole.EMBEDDING, "net.w": ParamRole.MATRIX}
    assert transposed_weights(lm) == {"net.w"}


def test_a_position_table_shorter_than_seq_len_fails_at_build_time(factory_module):
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(50, 8), nn.Embedding(16, 8)
            self.out = nn.Linear(8, 50)

        def forward(self, ids):
            return self.out(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))

    CausalLM(Positions(), 50, 16, "model.factory")  # fits
    with pytest.raises(ConfigError, match=r"positions >= 32 \(model.seq_len\)"):
        CausalLM(Positions(), 50, 32, "model.factory")
