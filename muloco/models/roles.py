"""Which parameters are embeddings, the output head, norms, biases or hidden matrices.

Muon is meant "only for hidden weight layers" (KellerJordan/Muon): embeddings, the head, norms, biases and
scalars go to AdamW. A model can say so itself with a `param_roles()` method; for any other `nn.Module` the
roles are inferred from module types, shapes and tied-ness (`infer_param_roles`). `transposed_weights` names
the weights stored as (in, out) (GPT-2's Conv1D), which Muon treats in their true (out, in) orientation.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

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
# Layers that store their weight as (in, out), the transpose of nn.Linear's (out, in): Hugging Face's
# `transformers.pytorch_utils.Conv1D` (GPT-2's attention and MLP). Matched by class name so that this module
# does not import transformers.
TRANSPOSED_WEIGHT_TYPES = ("Conv1D",)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def _io_embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """Hugging Face models say which modules are their input and output embeddings."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    try:
        return (get_in() if callable(get_in) else None), (get_out() if callable(get_out) else None)
    except (NotImplementedError, AttributeError):
        return None, None


def infer_param_roles(
    model: nn.Module, head: nn.Module | Literal["auto", "none"] = "auto"
) -> dict[str, ParamRole]:
    """Roles from module types and tied-ness, for models without their own `param_roles()`.

    Embedding modules -> embedding; norm layers -> norm; biases -> bias; other 1-D -> scalar. The head is
    `head` when the caller knows it (lm.py traces which layer returns the logits; "none": no layer does),
    else ("auto") the model's own `get_output_embeddings()` (Hugging Face), else the last Linear. A weight
    shared by two modules (tied input and output embeddings) is one parameter under its first name and
    keeps the role of its first module, the embedding: it reaches AdamW once.
    """
    if head == "auto":
        _, head = _io_embeddings(model)
        if head is None:
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            head = linears[-1] if linears else None
    roles: dict[str, ParamRole] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied: the first module that holds it decides
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.Embedding):
                roles[name] = ParamRole.EMBEDDING
            elif _is_norm(module):
                roles[name] = ParamRole.NORM
            elif param_name == "bias":
                roles[name] = ParamRole.BIAS
            elif param.ndim < 2:
                roles[name] = ParamRole.SCALAR
            elif module is head:
                roles[name] = ParamRole.HEAD
            else:
                roles[name] = ParamRole.MATRIX
    return roles


def transposed_weights(model: nn.Module) -> set[str]:
    """Names of 2-D weights stored as (in, out): Muon scales and orthogonalizes them as (out, in).

    The model's own `transposed_weights()` when it has one, else the weights of `TRANSPOSED_WEIGHT_TYPES`.
    """
    own = getattr(model, "transposed_weights", None)
    if callable(own):
        return set(own())
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(module.weight)]
        for module in model.modules()
        if type(module).__name__ in TRANSPOSED_WEIGHT_TYPES
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and module.weight.ndim == 2
        and id(module.weight) in names
    }


def param_roles(model: nn.Module) -> dict[str, ParamRole]:
    """The model's own `param_roles()` when it has one, else the inferred roles."""
    own = getattr(model, "param_roles", None)
    roles = own() if callable(own) else infer_param_roles(model)
    names = {name for name, _ in model.named_parameters()}
    missing = names - set(roles)
    assert not missing, f"param_roles() left out parameters: {sorted(missing)=}"
    return roles
