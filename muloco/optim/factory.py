"""The inner optimizer of one replica, built from the `inner:` config section.

`build_inner_optimizer(model, inner)` returns an `InnerOptimizer`: a thin wrapper over one or two torch
optimizers (Muon on hidden matrices + AdamW on the rest, or a single AdamW / SGD) that looks like one
optimizer to the trainer: `param_groups`, `step()`, `zero_grad()`, `state_dict()`, `load_state_dict()`.

inner.optimizer:
    muon        our Muon (muon.py) on the routed matrices + torch.optim.AdamW on the rest (MuLoCo)
    adamw       torch.optim.AdamW on everything with inner.adamw.* (DiLoCo)
    sgd         torch.optim.SGD(lr=inner.lr, momentum, nesterov, weight_decay) on everything
    torch_muon  torch.optim.Muon + AdamW, the reference implementation (2-D matrices, one NS triple)
    any other   a torch.optim class, a pytorch-optimizer name or module:Class (catalogue.py), built with
                lr=inner.lr and inner.kwargs, on every parameter or (inner.route=matrices) the hidden
                matrices with AdamW on the rest

With a `process_group` of R > 1 ranks (the ranks of one DiLoCo worker, which all-reduce their gradients every
step), inner.optimizer=muon uses `DistributedMuon`: each matrix's Newton-Schulz work and momentum live on one
rank. AdamW stays replicated on every rank (elementwise, cheap); torch_muon stays replicated too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from muloco.config import InnerConfig
from muloco.errors import ConfigError
from muloco.models.roles import param_roles, transposed_weights
from muloco.optim.catalogue import optimizer_class
from muloco.optim.distributed_muon import DistributedMuon
from muloco.optim.muon import Muon
from muloco.optim.orthogonalize import KELLER, resolve_coefficients
from muloco.optim.routing import Named, format_routing, muon_param_groups
from muloco.sharding import local

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# inner.ns_dtype -> the Newton-Schulz iteration's dtype (None: bf16 on CUDA and on CPUs with native bf16).
_NS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}

# inner.adjust_lr -> torch.optim.Muon's adjust_lr_fn; torch has no spectral scaling.
_TORCH_ADJUST_LR = {"original": "original", "match_rms_adamw": "match_rms_adamw"}


class InnerOptimizer:
    """Several torch optimizers driven as one.

    `param_groups` is the concatenation of the sub-optimizers' groups (the same dicts, so writing
    `group["lr"]` reaches the optimizer); every group carries "initial_lr", its base lr, and "name".
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], description: str = "") -> None:
        assert optimizers, "an InnerOptimizer needs at least one optimizer"
        self.optimizers = list(optimizers)
        self._description = description
        for opt in self.optimizers:
            for group in opt.param_groups:
                group.setdefault("initial_lr", group["lr"])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(
                f"optimizer state holds {len(states)} optimizers but this one has {len(self.optimizers)}; "
                "was it saved with a different inner.optimizer or routing?"
            )
        for opt, state in zip(self.optimizers, states, strict=True):
            opt.load_state_dict(state)

    def state_bytes(self) -> int:
        """Bytes this rank holds in optimizer state tensors (momentum, Adam moments, step counters; of
        a sharded model's state, its rows)."""
        return sum(
            local(value).numel() * value.element_size()
            for opt in self.optimizers
            for state in opt.state.values()
            for value in _tensors(state)
        )

    def describe(self) -> str:
        """The routing table: which optimizer updates which parameters."""
        return self._description


def _tensors(state: Any) -> list[torch.Tensor]:
    """The tensors in one entry of `optimizer.state`: a per-parameter dict as torch's optimizers keep, with
    lists of tensors inside (SOAP's eigenbases), or a bare tensor (MADGRAD keeps its step count so)."""
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, list | tuple):
        return [t for value in state for t in _tensors(value)]
    return []


def _adamw(params: list[nn.Parameter], inner: InnerConfig) -> torch.optim.AdamW:
    a = inner.adamw
    # foreach default: fused AdamW is not available on the CPU for every dtype.
    opt = torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay)
    opt.param_groups[0]["name"] = "adamw"
    return opt


def _split(model: nn.Module, inner: InnerConfig) -> tuple[Named, Named]:
    return muon_param_groups(model, inner.muon_params, inner.adamw_params)


def _torch_muon(params: list[nn.Parameter], names: list[str], inner: InnerConfig) -> torch.optim.Muon:
    if inner.adjust_lr not in _TORCH_ADJUST_LR:
        raise ConfigError(
            f"inner.adjust_lr={inner.adjust_lr!r} is not supported by torch.optim.Muon; "
            "use inner.adjust_lr=original or match_rms_adamw, or inner.optimizer=muon"
        )
    coefficients = resolve_coefficients(inner.ns_coefficients)
    if len(coefficients.triples) != 1:
        raise ConfigError(
            f"inner.ns_coefficients={inner.ns_coefficients!r} has per-step triples; torch.optim.Muon takes "
            f"one (a, b, c) triple: use inner.ns_coefficients={KELLER.name} or inner.optimizer=muon"
        )
    for name, p in zip(names, params, strict=True):
        if p.ndim != 2:
            raise ConfigError(
                f"torch.optim.Muon only takes 2-D parameters, got {name!r} of shape {tuple(p.shape)}; "
                "use inner.optimizer=muon or route it with inner.adamw_params"
            )
    opt = torch.optim.Muon(
        params,
        lr=inner.lr,
        weight_decay=inner.weight_decay,
        momentum=inner.momentum,
        nesterov=inner.nesterov,
        ns_coefficients=coefficients.triples[0],
        ns_steps=inner.ns_steps,
        adjust_lr_fn=_TORCH_ADJUST_LR[inner.adjust_lr],
    )
    opt.param_groups[0]["name"] = "muon"
    return opt


def _muon(
    params: list[nn.Parameter],
    inner: InnerConfig,
    process_group: ProcessGroup | None,
    transposed: list[nn.Parameter] = (),
    sharded: bool = False,
) -> Muon:
    hyperparameters: dict[str, Any] = dict(
        lr=inner.lr,
        weight_decay=inner.weight_decay,
        momentum=inner.momentum,
        nesterov=inner.nesterov,
        ns_steps=inner.ns_steps,
        ns_coefficients=inner.ns_coefficients,
        adjust_lr=inner.adjust_lr,
        ns_dtype=_NS_DTYPES[inner.ns_dtype],
    )
    # Weights stored as (in, out) get their own group: Muon steps them in their (out, in) orientation.
    transposed_ids = {id(p) for p in transposed}
    upright = [p for p in params if id(p) not in transposed_ids]
    groups = [{"params": upright}] if upright else []
    groups += [{"params": list(transposed), "transposed": True}] if transposed else []
    if sharded:  # FSDP2 parameters: each matrix gathered to its owner rank for Newton-Schulz
        from muloco.optim.sharded_muon import ShardedMuon  # imports DTensor: only here

        muon: Muon = ShardedMuon(groups, **hyperparameters)
    elif process_group is not None and dist.get_world_size(process_group) > 1:
        muon = DistributedMuon(groups, **hyperparameters, process_group=process_group)
    else:
        muon = Muon(groups, **hyperparameters)
    for group in muon.param_groups:
        group["name"] = "muon"
    return muon


def _one_optimizer(kind: str, params: list[nn.Parameter], inner: InnerConfig) -> torch.optim.Optimizer:
    """adamw, sgd or any other named optimizer over `params` (every parameter, or the routed matrices)."""
    if kind == "adamw":
        return _adamw(params, inner)
    if kind == "sgd":
        if inner.nesterov and inner.momentum == 0:
            raise ConfigError("inner.nesterov=true needs inner.momentum > 0 for sgd; set one of them")
        opt = torch.optim.SGD(
            params,
            lr=inner.lr,
            momentum=inner.momentum,
            nesterov=inner.nesterov,
            weight_decay=inner.weight_decay,
        )
    else:
        opt = _named_optimizer(kind, params, inner)
    opt.param_groups[0]["name"] = kind
    return opt


def _named_optimizer(kind: str, params: list[nn.Parameter], inner: InnerConfig) -> torch.optim.Optimizer:
    """inner.optimizer=kind (a torch.optim class, a pytorch-optimizer name or module:Class) with lr=inner.lr
    and inner.kwargs; what its constructor refuses (e.g. a shape it cannot step) is one config line."""
    cls = optimizer_class(kind)
    try:
        opt = cls(params, lr=inner.lr, **inner.kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"inner.optimizer={kind} refused its parameters or inner.kwargs: {exc} (inner.route=matrices "
            "gives it only the hidden matrices)"
        ) from None
    if len(opt.param_groups) != 1:
        raise ConfigError(
            f"inner.optimizer={kind} split its parameters into groups itself; it cannot be routed"
        )
    return opt


def build_inner_optimizer(
    model: nn.Module, inner: InnerConfig, process_group: ProcessGroup | None = None, sharded: bool = False
) -> InnerOptimizer:
    """The inner optimizer named by `inner.optimizer` over `model`'s trainable parameters, routed by
    `inner.route` (all parameters, or the hidden matrices with the rest on AdamW).

    process_group: the ranks of this DiLoCo worker, which average their gradients before every `step()`;
    with more than one rank, inner.optimizer=muon splits its Newton-Schulz work across them
    (`DistributedMuon`, which must then be stepped on every rank). None: one process, plain `Muon`.
    Every other optimizer is replicated on the ranks: they step the same averaged gradients.
    sharded: the model is wrapped with FSDP2 (sharding.py); Muon is then `ShardedMuon` (each matrix
    orthogonalized on one owner rank), AdamW and SGD step the DTensor shards as they are.
    """
    roles = param_roles(model)
    kind = inner.optimizer
    muon_like = kind in ("muon", "torch_muon")
    route = inner.route if inner.route != "auto" else ("matrices" if muon_like else "all")
    if route == "all":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters for the inner optimizer")
        opt = _one_optimizer(kind, [p for _, p in named], inner)
        return InnerOptimizer([opt], format_routing({kind: named}, roles))

    matrices_named, adamw_named = _split(model, inner)
    optimizers: list[torch.optim.Optimizer] = []
    if matrices_named:
        names, params = [n for n, _ in matrices_named], [p for _, p in matrices_named]
        transposed_names = transposed_weights(model)
        transposed = [p for n, p in matrices_named if n in transposed_names]
        if kind == "torch_muon":
            if transposed:
                raise ConfigError(
                    f"inner.optimizer=torch_muon steps weights as stored, and {len(transposed)} are stored "
                    "transposed (in, out), e.g. GPT-2's Conv1D; use inner.optimizer=muon"
                )
            optimizers.append(_torch_muon(params, names, inner))
        elif kind == "muon":
            optimizers.append(_muon(params, inner, process_group, transposed, sharded))
        else:
            optimizers.append(_one_optimizer(kind, params, inner))
    if adamw_named:
        optimizers.append(_adamw([p for _, p in adamw_named], inner))
    if not optimizers:
        raise ConfigError("the model has no trainable parameters for the inner optimizer")
    label = "muon" if muon_like else kind
    description = format_routing({label: matrices_named, "adamw": adamw_named}, roles)
    return InnerOptimizer(optimizers, description)
