"""Models: what a run trains and which parameters go to Muon.

- `gpt.py`: the built-in GPT and its size presets; `norms.py`: its LayerNorm, whose CPU gradients do not
  depend on torch's thread count.
- `factory.py`: `model.factory`, the user's own model; `hf.py`: `model.hf`, Hugging Face causal LMs from a
  config; `lm.py`: `CausalLM`, the wrapper that gives both the GPT's contract and checks them.
- `build.py`: `build_model(model_cfg, vocab_size)`, the one entry point.
- `roles.py`: parameter roles (embedding, head, norm, bias, matrix) and transposed weights, for routing.
"""

from muloco.models.build import build_model, describe_model
from muloco.models.gpt import GPT, GPTConfig, build_gpt
from muloco.models.lm import CausalLM
from muloco.models.roles import ParamRole, infer_param_roles, param_roles, transposed_weights

__all__ = [
    "GPT",
    "CausalLM",
    "GPTConfig",
    "ParamRole",
    "build_gpt",
    "build_model",
    "describe_model",
    "infer_param_roles",
    "param_roles",
    "transposed_weights",
]
