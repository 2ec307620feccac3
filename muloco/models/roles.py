"""Which parameters are embeddings, the output head, norms, biases or hidden matrices.

Muon is meant "only for hidden weight layers" (KellerJordan/Muon): embeddings, the head, norms, biases and
scalars go to AdamW. A model can say so itself with a `param_roles()` method; for any other `nn.Module` the
roles are inferred from module types and shapes.
"""

from __future__ import annotations

from enum import Enum

from torch import nn


class ParamRole(str, Enum):
    EMBEDDING = "embedding"
    HEAD = "head"
    NORM = "norm"
    BIAS = "bias"
    SCALAR = "scalar"  # 0-D / 1-D parameters that are not norms or biases
    MATRIX = "matrix"  # hidden 2-D+ weights: the ones Muon is for

    @property
    def is_hidden_matrix(self) -> bool:
        return self is ParamRole.MATRIX


_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)


def infer_param_roles(model: nn.Module) -> dict[str, ParamRole]:
    """Roles from module types: Embedding -> embedding, norm layers -> norm, the last Linear -> head."""
    roles: dict[str, ParamRole] = {}
    last_linear = None
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_linear = module_name
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.Embedding):
                roles[name] = ParamRole.EMBEDDING
            elif isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower():
                roles[name] = ParamRole.NORM
            elif param_name == "bias":
                roles[name] = ParamRole.BIAS
            elif param.ndim < 2:
                roles[name] = ParamRole.SCALAR
            elif module_name == last_linear:
                roles[name] = ParamRole.HEAD
            else:
                roles[name] = ParamRole.MATRIX
    return roles


def param_roles(model: nn.Module) -> dict[str, ParamRole]:
    """The model's own `param_roles()` when it has one, else the inferred roles."""
    own = getattr(model, "param_roles", None)
    roles = own() if callable(own) else infer_param_roles(model)
    names = {name for name, _ in model.named_parameters()}
    missing = names - set(roles)
    assert not missing, f"param_roles() left out parameters: {sorted(missing)=}"
    return roles
