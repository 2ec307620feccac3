"""Muon: momentum, then Newton-Schulz orthogonalization, for hidden weight matrices.

The maths is in pure functions (`muon_update`, `adjusted_lr`, and `orthogonalize.py`); `Muon` only
holds the momentum buffers and walks its parameter groups. Per step, for a weight W (rows=fan_out,
cols=fan_in; a conv weight is flattened to (out, in*kh*kw)):

    B <- momentum B + (1 - momentum) g                    # EMA, `buf.lerp_(g, 1 - momentum)`
    U  = g + momentum (B - g)  if nesterov else B         # `g.lerp(B, momentum)`, as torch.optim.Muon
    O  = NS(U / (||U||_F + eps))                          # orthogonalize.py, bf16 where that is fast
    W <- (1 - lr wd) W - adjusted_lr(lr, W.shape) O       # decoupled weight decay with the plain lr

Muon is for hidden matrices only (Keller Jordan): embeddings, the head, norms and biases belong on
AdamW (routing.py). Same-shape matrices are stacked into one (N, rows, cols) batch, so a transformer's
dozens of matrices cost a handful of Newton-Schulz calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from muloco.optim.orthogonalize import (
    EPS,
    Coefficients,
    CoefficientsLike,
    Method,
    default_ns_dtype,
    ns_iterate,
    resolve_coefficients,
)

AdjustLR = Literal["spectral", "original", "match_rms_adamw"]
ADJUST_LR_MODES: tuple[str, ...] = ("spectral", "original", "match_rms_adamw")

# Cap on the elements of one stacked batch (2^26 = 128 MiB in bf16): bigger buckets run in chunks.
MAX_STACK_ELEMENTS = 1 << 26


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, cols) that Muon sees: (out, in) for a linear weight, (out, in*kh*kw) for a conv weight."""
    assert len(shape) >= 2, f"{shape=}"
    return shape[0], math.prod(shape[1:])


def oriented(t: Tensor, transposed: bool) -> Tensor:
    """A weight, its gradient or momentum as Muon sees it, (out, in): a view of the transpose for weights
    stored as (in, out) (param group key `transposed`, e.g. GPT-2's Conv1D), else `t` itself."""
    return t.mT if transposed else t


def adjusted_lr(lr: float, shape: Sequence[int], mode: AdjustLR = "spectral") -> float:
    """The per-matrix step size for a weight of `shape` (fan_out = rows, fan_in = cols).

    spectral:        lr * sqrt(fan_out / fan_in)      (spectral-norm scaling; Dion, MuLoCo's default)
    original:        lr * sqrt(max(1, rows / cols))   (Keller Jordan; torch.optim.Muon "original")
    match_rms_adamw: lr * 0.2 * sqrt(max(rows, cols)) (Moonlight, arXiv:2502.16982; torch's
                     "match_rms_adamw": the update's RMS matches AdamW's ~0.2, so AdamW lrs carry over)
    """
    rows, cols = matrix_shape(shape)
    if mode == "spectral":
        return lr * math.sqrt(rows / cols)
    if mode == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr must be one of {', '.join(ADJUST_LR_MODES)}, got {mode!r}")


def stack_normalized(updates: Sequence[Tensor], norm_scale: float, eps: float, dtype: torch.dtype) -> Tensor:
    """Flatten each update to (rows, cols), divide by its Frobenius norm (* norm_scale) + eps and write
    it into one (N, rows, cols) tensor of `dtype`: the division and the cast are one pass per matrix."""
    flat = [u.reshape(u.shape[0], -1) for u in updates]  # each (rows, cols)
    norms = torch._foreach_norm(flat)  # computed in the updates' dtype, before any cast
    X = torch.empty((len(flat), *flat[0].shape), dtype=dtype, device=flat[0].device)  # (N, rows, cols)
    for i, (u, norm) in enumerate(zip(flat, norms, strict=True)):
        torch.div(u, norm * norm_scale + eps, out=X[i])
    return X


def muon_update(
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    *,
    momentum: float,
    nesterov: bool,
    coefficients: Coefficients,
    steps: int,
    dtype: torch.dtype,
    method: Method = "auto",
    eps: float = EPS,
) -> Tensor:
    """The orthogonalized updates of N same-shape matrices, (N, rows, cols) in `dtype`.

    Updates `momentum_buffers` in place (the EMA); everything else is a fresh tensor.
    """
    torch._foreach_lerp_(list(momentum_buffers), list(grads), 1 - momentum)
    updates = (
        torch._foreach_lerp(list(grads), list(momentum_buffers), momentum) if nesterov else momentum_buffers
    )
    X = stack_normalized(updates, coefficients.norm_scale, eps, dtype)  # (N, rows, cols)
    return ns_iterate(X, coefficients.schedule(steps), method)


def _buckets(params: Iterable[Tensor]) -> list[list[Tensor]]:
    """Parameters with a gradient, grouped by (shape, device, dtype) in first-seen order, in chunks of
    at most MAX_STACK_ELEMENTS elements."""
    groups: dict[tuple[Any, ...], list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        groups.setdefault((tuple(p.shape), p.device, p.dtype), []).append(p)
    chunks = []
    for same in groups.values():
        size = max(1, MAX_STACK_ELEMENTS // same[0].numel())
        chunks.extend(same[i : i + size] for i in range(0, len(same), size))
    return chunks


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan 2024) for 2-D+ hidden weights; see the module docstring for the update.

    Args:
        lr: base learning rate; each matrix steps by `adjusted_lr(lr, shape, adjust_lr)`.
        weight_decay: decoupled, `W *= 1 - lr * weight_decay` with the unadjusted lr.
        momentum, nesterov: EMA momentum and the Nesterov look-ahead, as torch.optim.Muon.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: keller | muloco | polar_express, or a list of (a, b, c) triples (the last one
            repeats when ns_steps is longer than the list).
        adjust_lr: spectral | original | match_rms_adamw (see `adjusted_lr`).
        ns_dtype: internal; the iteration's dtype, None = bf16 on CUDA and on CPUs with native bf16.
        ns_method: internal; auto | standard | gram (see newton_schulz.uses_gram).

    State: exactly one tensor per parameter, `momentum_buffer`, shaped like the parameter.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: CoefficientsLike = "keller",
        adjust_lr: AdjustLR = "spectral",
        *,
        ns_dtype: torch.dtype | None = None,
        ns_method: Method = "auto",
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"Muon weight_decay must be >= 0, got {weight_decay}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be an integer >= 1, got {ns_steps!r}")
        if adjust_lr not in ADJUST_LR_MODES:
            raise ValueError(f"Muon adjust_lr must be one of {', '.join(ADJUST_LR_MODES)}, got {adjust_lr!r}")
        if ns_method not in ("auto", "standard", "gram"):
            raise ValueError(f"Muon ns_method must be auto, standard or gram, got {ns_method!r}")
        resolve_coefficients(ns_coefficients)  # fail here, not at the first step
        if not isinstance(ns_coefficients, str | Coefficients):
            ns_coefficients = tuple(tuple(float(v) for v in t) for t in ns_coefficients)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            adjust_lr=adjust_lr,
            transposed=False,
        )
        self.ns_dtype = ns_dtype
        self.ns_method: Method = ns_method
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"Muon needs 2-D or larger parameters, got one of shape {tuple(p.shape)}; "
                    "put vectors and scalars on AdamW (muloco.optim.muon_param_groups routes them)"
                )
            if self.param_groups[-1]["transposed"] and p.ndim != 2:
                raise ValueError(f"Muon's transposed groups take 2-D weights (in, out), got {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            coefficients = resolve_coefficients(group["ns_coefficients"])
            for params in _buckets(group["params"]):
                self._step_bucket(params, group, coefficients)
        return loss

    def _step_bucket(self, params: list[Tensor], group: dict[str, Any], coefficients: Coefficients) -> None:
        """One Newton-Schulz call for same-shape parameters, then the weight update."""
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        device = params[0].device
        dtype = self.ns_dtype or default_ns_dtype(device)
        # An autocast context around step() must not change the iteration's dtype.
        with torch.autocast(device.type, enabled=False), torch.profiler.record_function("muloco::muon_ns"):
            transposed = group.get("transposed", False)  # absent in optimizer states saved before it
            update = muon_update(
                [oriented(p.grad, transposed) for p in params],
                [oriented(b, transposed) for b in buffers],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                coefficients=coefficients,
                steps=group["ns_steps"],
                dtype=dtype,
                method=self.ns_method,
            )  # (N, rows, cols)
        lr = group["lr"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        shape = oriented(params[0], transposed).shape  # (out, in)
        step_size = adjusted_lr(lr, shape, group["adjust_lr"])
        for p, u in zip(params, update, strict=True):
            oriented(p, transposed).add_(u.view(shape), alpha=-step_size)
