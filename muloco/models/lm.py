"""`CausalLM`: any model that maps token ids to logits, behind the built-in GPT's contract.

The trainer calls `model(ids, targets) -> loss` and evals and `muloco sample` call `model(ids) -> logits`.
A factory model (factory.py) or a Hugging Face model (hf.py) only has to map ids (B, T) to logits
(B, T, vocab): a tensor, an object with `.logits` (Hugging Face outputs) or a tuple whose first item is the
logits. The wrapper adds the loss (the same cross-entropy as gpt.py) and finds the output head by tracing
which layer returns the logits, so parameter roles do not rest on "the last Linear is the head".
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from muloco.errors import ConfigError, one_line
from muloco.models.roles import ParamRole, infer_param_roles, transposed_weights

log = logging.getLogger("muloco")


def unwrap_logits(output: Any) -> Any:
    """The logits in a model's output: the tensor itself, `output.logits`, or `output[0]`."""
    if torch.is_tensor(output):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple | list) and output:
        return output[0]
    return output


class CausalLM(nn.Module):
    """`net` (token ids -> logits) with `forward(idx, targets=None)` -> logits, or the mean cross-entropy.

    Parameter names gain the prefix `net.`; `inner.muon_params` / `adamw_params` regexes match anywhere
    in the name, so patterns such as `q_proj` work unchanged.
    """

    def __init__(
        self,
        net: nn.Module,
        vocab_size: int,
        seq_len: int,
        field: str,
        call_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.vocab_size, self.seq_len, self.field = vocab_size, seq_len, field
        self.call_kwargs = dict(call_kwargs or {})  # e.g. Hugging Face's use_cache=False
        self.head_name = self._probe()  # the qualified name of the layer that returns the logits, if any

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return unwrap_logits(self.net(idx, **self.call_kwargs))  # (B, T, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.logits(idx)  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def param_roles(self) -> dict[str, ParamRole]:
        """The wrapped model's own `param_roles()` (under `net.`) when it has one, else roles inferred
        with the traced head."""
        own = getattr(self.net, "param_roles", None)
        if callable(own):
            return {f"net.{name}": role for name, role in own().items()}
        head = self.get_submodule(self.head_name) if self.head_name else None
        return infer_param_roles(self, head=head if head is not None else "none")

    def transposed_weights(self) -> set[str]:
        """The wrapped model's weights stored as (in, out) (roles.transposed_weights), under `net.`."""
        return {f"net.{name}" for name in transposed_weights(self.net)}

    # -- the build-time check -------------------------------------------------------------------------
    def _probe(self) -> str | None:
        """Run ids (1, seq_len) holding the largest id of the data's vocabulary; check the logits' shape
        and return the name of the weight layer whose output is the logits (or, when none is, the only
        layer whose output has their shape; else None)."""
        V, T = self.vocab_size, self.seq_len
        idx = torch.full((1, T), V - 1, dtype=torch.long)
        idx[0, 0] = 0
        outputs: dict[str, Any] = {}
        hooks = [
            module.register_forward_hook(lambda _m, _i, out, name=name: outputs.__setitem__(name, out))
            for name, module in self.named_modules()
            if isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.ndim == 2
        ]
        was_training = self.training
        self.eval()  # no dropout draws from the run's RNG, no norm statistics updated by the probe
        try:
            with torch.no_grad():
                logits = self.logits(idx)
        except IndexError as exc:
            raise ConfigError(
                f"{self.field}: the model fails on token ids of shape (1, {T}) up to id {V - 1} "
                f"({one_line(exc)}); its "
                f"token embedding needs >= {V} rows (the data's vocabulary) and its positions >= {T} "
                "(model.seq_len)"
            ) from None
        except Exception as exc:  # the user's code: any failure is theirs to fix, in one line
            raise ConfigError(
                f"{self.field}: the model's forward failed on token ids of shape (1, {T}) "
                f"({one_line(exc)}); it must map ids (B, T) to logits (B, T, vocab)"
            ) from None
        finally:
            self.train(was_training)
            for hook in hooks:
                hook.remove()
        if not torch.is_tensor(logits) or logits.ndim != 3 or tuple(logits.shape[:2]) != (1, T):
            got = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
            raise ConfigError(
                f"{self.field}: the model returned {got} for token ids of shape (1, {T}); it must return "
                "logits (B, T, vocab) (a tensor, an output with .logits, or a tuple starting with them)"
            )
        if logits.shape[-1] < V:
            raise ConfigError(
                f"{self.field}: the model predicts {logits.shape[-1]} tokens but the data's vocabulary has "
                f"{V}; set the model's vocab_size to >= {V}"
            )
        exact = [name for name, out in outputs.items() if out is logits]
        if exact:
            return exact[-1]
        # Logits scaled or capped after the head: the one layer whose output has the logits' shape. When
        # several have it (a hidden width equal to the vocabulary), guessing could take a hidden matrix
        # off Muon: no head, and the wrapped model can say it with its own param_roles().
        shaped = [n for n, out in outputs.items() if torch.is_tensor(out) and out.shape == logits.shape]
        if len(shaped) > 1:
            log.warning(
                "%s: %d layers output the logits' shape (%s) and none returns the logits themselves; no "
                "layer is treated as the head (define param_roles() on the model to name it)",
                self.field,
                len(shaped),
                ", ".join(shaped),
            )
        return shaped[0] if len(shaped) == 1 else None
