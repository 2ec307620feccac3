"""Any optimizer as the inner optimizer: `inner.optimizer` names resolved to a torch Optimizer class, and
`inner.kwargs` checked against that class's constructor, before anything is built or written.

A name is, in this order:
    muon | adamw | sgd | torch_muon   built in (factory.py); configured with the inner.* fields
    package.module:Class              imported; must subclass torch.optim.Optimizer
    a torch.optim class name          Adafactor, NAdam, RAdam, Adagrad, ... (case as torch spells it)
    a pytorch-optimizer name          lion, soap, ademamix, adopt, ... (the `optimizers` extra)

The trainer calls `step()` with no closure after an ordinary `backward()`, steps between syncs, and treats
the parameters as the model: optimizers that need more than that are refused with one line (check.py runs
these checks when a config is loaded for a run).

torch is imported by the functions that need it, not with this module: the built-in names alone (what the
config check of `muloco launch` and `muloco config` needs) import no torch.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import io
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The inner optimizers built from the inner.* fields (factory.py); any other name is resolved here.
BUILT_IN_OPTIMIZERS = ("muon", "adamw", "sgd", "torch_muon")

# Constructor arguments the framework fills: the parameters (from the routing) and the lr (inner.lr, so that
# a sweep tunes every optimizer through the same key and the lr schedule scales it).
_FILLED = ("params", "lr")


def torch_optim_names() -> list[str]:
    """torch.optim's optimizer classes by name (LBFGS included: it is refused with its reason)."""
    import torch

    names = []
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        if (
            inspect.isclass(value)
            and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer
        ):
            names.append(name)
    return sorted(names)


def _catalogue():
    try:
        import pytorch_optimizer
    except ImportError:
        return None
    return pytorch_optimizer


def _unknown(name: str) -> ValueError:
    catalogue = _catalogue()
    known = [
        *BUILT_IN_OPTIMIZERS,
        *torch_optim_names(),
        *(catalogue.get_supported_optimizers() if catalogue else []),
    ]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    close += [k for k in known if k.lower() == name.lower() and k not in close]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    extra = "" if catalogue else " (pip install 'muloco[optimizers]' adds the pytorch-optimizer catalogue)"
    return ValueError(
        f"unknown optimizer {name!r}; {hint}use muon, adamw, sgd, torch_muon, a torch.optim class "
        f"(e.g. NAdam), a pytorch-optimizer name (e.g. lion){extra} or package.module:Class"
    )


def _import_class(spec: str) -> type:
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for optimizer {spec!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"module {module_name!r} has no {class_name!r} (optimizer {spec!r})")
    return cls


@functools.lru_cache(maxsize=64)
def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class `inner.optimizer=name` names (not a built-in one); ValueError with the fix otherwise.
    Cached: the config's field and model checks and every replica's factory ask for it (a failure is not
    cached, so a module installed later is found)."""
    import torch

    if ":" in name:
        cls = _import_class(name)
    elif name in torch_optim_names():
        cls = getattr(torch.optim, name)
    else:
        catalogue = _catalogue()
        if catalogue is None or name.lower() not in catalogue.get_supported_optimizers():
            raise _unknown(name)
        cls = catalogue.load_optimizer(name.lower())
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is not a torch.optim.Optimizer subclass; name an optimizer class")
    _check_contract(name, cls)
    return cls


def _check_contract(name: str, cls: type[torch.optim.Optimizer]) -> None:
    """Refuse what the inner loop cannot give: a closure, second-order gradients, train/eval weights."""
    step = inspect.signature(cls.step).parameters
    closure = step.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{name} needs a closure that re-evaluates the loss at every step (line-search / sharpness "
            "methods); the inner loop steps once per backward: use another optimizer"
        )
    if "hessian" in step:
        raise ValueError(
            f"{name} needs second-order information (loss.backward(create_graph=True)), which the inner "
            "loop does not compute: use another optimizer"
        )
    if callable(getattr(cls, "eval", None)) and callable(getattr(cls, "train", None)):
        raise ValueError(
            f"{name} keeps separate train and eval weights (.train()/.eval(), schedule-free); a "
            "pseudo-gradient from either would be wrong: use another optimizer"
        )


def constructor_arguments(cls: type[torch.optim.Optimizer]) -> list[str]:
    """The named keyword arguments of `cls(params, lr=..., ...)`. A catch-all **kwargs is not counted:
    pytorch-optimizer's classes take one and drop what they do not know, so a misspelt name would
    silently train with the default."""
    parameters = inspect.signature(cls.__init__).parameters
    return [
        name
        for name, p in parameters.items()
        if name not in ("self", *_FILLED) and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def check_kwargs(name: str, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    """One line naming an argument the class does not take (or one the framework fills)."""
    for filled in _FILLED:
        if filled in kwargs:
            fix = "set inner.lr" if filled == "lr" else "parameters come from inner.route"
            raise ValueError(f"inner.kwargs.{filled} is set by muloco for {name}: {fix}")
    accepted = constructor_arguments(cls)
    for key in kwargs:
        if key not in accepted:
            raise ValueError(
                f"inner.kwargs.{key} is not an argument of {cls.__name__} ({name}); "
                f"it takes: {', '.join(accepted) or 'no other arguments'}"
            )


def trial_step(
    name: str, cls: type[torch.optim.Optimizer], lr: float, kwargs: dict[str, Any], route: str
) -> None:
    """Build `cls` and take one step on stand-ins for what the route gives it (a hidden matrix; with
    route all also a vector, as norms and biases are), so that a class that refuses those shapes or
    arguments is one config line before a run directory exists, not a failure after."""
    import torch

    stand_ins = [torch.zeros(4, 3, requires_grad=True)]
    if route == "all":
        stand_ins.append(torch.zeros(3, requires_grad=True))
    try:
        opt = cls(stand_ins, lr=lr, **kwargs)
        for p in stand_ins:
            p.grad = torch.full_like(p, 0.1)
        opt.step()
    except Exception as exc:  # any failure of a third-party class is the user's config to fix
        shapes = " and a vector" if route == "all" else ""
        raise ValueError(
            f"{name} cannot step a matrix{shapes} with lr={lr} and inner.kwargs={kwargs}: {exc}"
            + ("; inner.route=matrices gives it only the hidden matrices" if route == "all" else "")
        ) from None
    if any("lr" not in group for group in opt.param_groups):
        raise ValueError(
            f"{name} keeps no lr in its param groups: inner.lr and the lr schedule cannot drive it; use "
            "another optimizer"
        )
    _check_checkpointable(name, opt)


def _check_checkpointable(name: str, opt: torch.optim.Optimizer) -> None:
    """Checkpoints load with torch.load(weights_only=True) (checkpoint/plain.py): tensors, numbers,
    strings and containers. A class that keeps other objects in its state (a deque, a custom class)
    could train but never resume: refused now rather than at the first resume."""
    import torch

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
        kept = f"{found.group(1)} objects" if found else "objects other than tensors and containers"
        raise ValueError(
            f"{name} keeps {kept} in its state, which a checkpoint cannot load safely (weights_only): "
            "its runs could not resume; use another optimizer"
        ) from None
