"""Which parameters Muon updates and which AdamW updates.

Default: hidden matrices (`ParamRole.MATRIX` from models/roles.py) on Muon; embeddings, the head, norms,
biases and scalars on AdamW (Keller Jordan: Muon is "only for hidden weight layers"). The config can
override by name with regexes (`re.search`): `inner.adamw_params` wins over everything, then
`inner.muon_params`, then the role. Frozen parameters (requires_grad=False) are left out.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from torch import nn

from muloco.errors import ConfigError
from muloco.models.roles import ParamRole, param_roles

Named = list[tuple[str, nn.Parameter]]


def _compile(patterns: Sequence[str], field: str) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise ConfigError(
                f"{field}: pattern '{pattern}' is not a valid regex ({exc}); fix or remove it"
            ) from exc
    return compiled


def _unmatched(compiled: list[re.Pattern[str]], names: list[str], field: str) -> None:
    for pattern in compiled:
        if not any(pattern.search(name) for name in names):
            example = f"; names look like {names[0]!r}" if names else ""
            raise ConfigError(f"{field}: pattern '{pattern.pattern}' matched no parameters{example}")


def muon_param_groups(
    model: nn.Module, muon_params: Sequence[str] = (), adamw_params: Sequence[str] = ()
) -> tuple[Named, Named]:
    """(muon, adamw) lists of (name, parameter), each in `model.named_parameters()` order.

    Raises ConfigError (a ValueError) naming the field when a pattern matches nothing, when
    `inner.muon_params` forces a parameter with fewer than 2 dims onto Muon, or when a regex is invalid.
    """
    roles = param_roles(model)
    to_muon = _compile(muon_params, "inner.muon_params")
    to_adamw = _compile(adamw_params, "inner.adamw_params")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    names = [name for name, _ in named]
    _unmatched(to_muon, names, "inner.muon_params")
    _unmatched(to_adamw, names, "inner.adamw_params")

    muon: Named = []
    adamw: Named = []
    for name, p in named:
        if any(rx.search(name) for rx in to_adamw):
            adamw.append((name, p))
        elif forced := next((rx for rx in to_muon if rx.search(name)), None):
            if p.ndim < 2:
                raise ConfigError(
                    f"inner.muon_params: pattern '{forced.pattern}' puts parameter {name!r} of shape "
                    f"{tuple(p.shape)} on Muon, which needs >= 2 dims; narrow the pattern"
                )
            muon.append((name, p))
        elif roles[name] is ParamRole.MATRIX:
            assert p.ndim >= 2, f"a MATRIX role needs >= 2 dims: {name=} {tuple(p.shape)=}"
            muon.append((name, p))
        else:
            adamw.append((name, p))
    return muon, adamw


def format_routing(groups: dict[str, Named], roles: dict[str, ParamRole]) -> str:
    """A small table: one row per optimizer group with tensor and parameter counts and the roles in it."""
    width = max(8, *(len(group) for group in groups))
    lines = [f"{'group':<{width}} {'tensors':>7} {'parameters':>12}  roles"]
    for group, named in groups.items():
        count = Counter(roles[name].value for name, _ in named)
        kinds = ", ".join(f"{role} x{n}" for role, n in sorted(count.items())) or "-"
        numel = sum(p.numel() for _, p in named)
        lines.append(f"{group:<{width}} {len(named):>7} {numel:>12,}  {kinds}")
    return "\n".join(lines)


def routing_table(model: nn.Module, muon_params: Sequence[str] = (), adamw_params: Sequence[str] = ()) -> str:
    """The Muon/AdamW split of `model` as a table (the trainer logs it at start)."""
    muon, adamw = muon_param_groups(model, muon_params, adamw_params)
    return format_routing({"muon": muon, "adamw": adamw}, param_roles(model))
