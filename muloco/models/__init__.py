"""Models: `gpt.py` (the built-in GPT and its size presets) and `roles.py` (which parameters go to Muon)."""

from muloco.models.gpt import GPT, GPTConfig, build_model
from muloco.models.roles import ParamRole, infer_param_roles, param_roles

__all__ = ["GPT", "GPTConfig", "ParamRole", "build_model", "infer_param_roles", "param_roles"]
