"""Error feedback: each replica re-sends, in later rounds, what compression dropped.

Per replica and parameter name, with a compressor Q and its decoder deQ (MuLoCo, Therien et al. 2025,
arXiv 2505.23725, Sec. 3 / Algorithm 2; error feedback after Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes"):

    e = decay * e + delta          # accumulate the new pseudogradient (decay: the paper's beta)
    payload = Q(e)                 # what is sent
    e = e - alpha * deQ(payload)   # keep what did not get through

With decay = alpha = 1 the buffer is exactly the running difference between what was meant and what was
sent: sum_t delta_t - sum_t deQ(payload_t) = e_T. decay < 1 forgets stale residue (the paper uses 0.9).
The subtraction uses `deQ(payload)`, the very bytes the receiver decodes: both sides agree on what was sent.
"""

from __future__ import annotations

import torch

from muloco.compress.base import Compressor


class ErrorFeedback:
    """The error-feedback buffers of one replica, keyed by parameter name (fp32, on the delta's device)."""

    def __init__(self, decay: float = 0.9, alpha: float = 1.0):
        for name, v in (("ef_decay", decay), ("ef_alpha", alpha)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        self.decay, self.alpha = float(decay), float(alpha)
        self.buffers: dict[str, torch.Tensor] = {}

    def encode(self, name: str, delta: torch.Tensor, compressor: Compressor) -> bytes:
        """Fold `delta` into the buffer of `name`, compress it, keep the residual; return the payload."""
        return self.send(self.accumulate(name, delta), compressor)

    def accumulate(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """e = decay * e + delta for the buffer of `name`; returns it (to `send`, whole or by rows)."""
        e = self.buffers.get(name)
        if e is None:
            e = self.buffers[name] = delta.detach().float().clone()  # decay * 0 + delta
        else:
            if e.shape != delta.shape:
                raise ValueError(
                    f"error feedback buffer {name!r} has shape {tuple(e.shape)}, "
                    f"the delta {tuple(delta.shape)}: "
                    "was the model changed since the buffer (or checkpoint) was made?"
                )
            e.mul_(self.decay).add_(delta.detach().to(e.device, torch.float32))
        return e

    def send(self, e: torch.Tensor, compressor: Compressor) -> bytes:
        """Compress `e` (a buffer or a view of rows of one) and keep the residual in it, in place."""
        payload = compressor.encode(e)
        e.sub_(compressor.decode(payload).to(e.device), alpha=self.alpha)
        return payload

    def send_many(self, buffers: list[torch.Tensor], compressor: Compressor) -> list[bytes]:
        """`send` of each buffer (or rows of one), encoded together (the same bytes, see compress/many.py)."""
        payloads, decoded = compressor.encode_with_decoded(buffers)
        for e, d in zip(buffers, decoded, strict=True):
            e.sub_(d.to(e.device), alpha=self.alpha)
        return payloads

    def reset(self) -> None:
        self.buffers.clear()

    def forget(self, names: list[str]) -> None:
        """Drop the buffers of these parameters (a sync of theirs that was never applied)."""
        for name in names:
            self.buffers.pop(name, None)

    def state_dict(self) -> dict:
        """Plain tensors and strings only (loads with torch.load(weights_only=True))."""
        return {"buffers": {k: v.detach().cpu().clone() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        buffers = state.get("buffers") if isinstance(state, dict) else None
        if not isinstance(buffers, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items()
        ):
            raise ValueError("error feedback state must be {'buffers': {name: tensor}}")
        self.buffers = {k: v.detach().float().clone() for k, v in buffers.items()}
