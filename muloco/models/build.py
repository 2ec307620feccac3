"""`build_model(model_cfg, vocab_size)`: the model a run trains, from the `model:` config section.

The built-in GPT (gpt.py, size presets), a factory model (`model.factory`, factory.py) or a Hugging Face
causal LM (`model.hf`, hf.py). The last two are wrapped in `CausalLM` (lm.py), which checks them once on
a probe sequence and gives them the GPT's `model(ids, targets) -> loss` contract.
"""

from __future__ import annotations

from torch import nn

from muloco.models.factory import build_from_factory
from muloco.models.gpt import build_gpt
from muloco.models.hf import build_hf_model
from muloco.models.lm import CausalLM


def build_model(model_cfg, vocab_size: int) -> nn.Module:
    seq_len = model_cfg.seq_len
    if model_cfg.factory is not None:
        net = build_from_factory(model_cfg.factory, model_cfg.kwargs, vocab_size, seq_len)
        return CausalLM(net, vocab_size, seq_len, "model.factory")
    if model_cfg.hf is not None:
        net = build_hf_model(model_cfg.hf, vocab_size, seq_len)
        return CausalLM(net, vocab_size, seq_len, "model.hf", call_kwargs={"use_cache": False})
    return build_gpt(model_cfg, vocab_size)


def describe_model(model_cfg) -> str:
    """One line for logs: what kind of model the config builds."""
    if model_cfg.factory is not None:
        return f"factory {model_cfg.factory}"
    if model_cfg.hf is not None:
        hf = model_cfg.hf
        if isinstance(hf, str):
            return f"hf {hf}"
        if hf.get("pretrained") is not None:
            return f"hf pretrained={hf['pretrained']}"
        return f"hf {hf.get('model_type', hf.get('config'))}"
    return f"gpt preset={model_cfg.preset} d_model={model_cfg.d_model} n_layers={model_cfg.n_layers}"
