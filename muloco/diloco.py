"""`DiLoCo`: DiLoCo/MuLoCo around a user's own model and training loop (in the spirit of
torchft.local_sgd.DiLoCo).

    diloco = DiLoCo(model, inner_optimizer, sync_every=30)
    for x, y in data:
        loss_fn(model(x), y).backward()
        inner_optimizer.step(); inner_optimizer.zero_grad()
        diloco.step()          # every sync_every calls: average pseudogradients, outer Nesterov step

Each process holds one replica; the backend averages over processes (the local backend: one process, K = 1).
`compression` is a `muloco.compress` compressor (applied to every parameter) or a `compression:` config
section (`muloco.config.CompressionConfig`: skip rules and error feedback as in `muloco train`).
"""

from __future__ import annotations

import torch
from torch import nn

from muloco.codec import PseudogradientCodec
from muloco.comm import Backend, LocalBackend
from muloco.compress import Compressor, ErrorFeedback
from muloco.config import CompressionConfig
from muloco.models.roles import param_roles
from muloco.outer import OuterOptimizer, pseudogradient
from muloco.reduce import mean_compressed, mean_uncompressed


class DiLoCo:
    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        backend: Backend | None = None,
        compression: Compressor | CompressionConfig | None = None,
    ) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 (H, inner steps between syncs), got {sync_every}")
        if outer_lr <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(
                f"need outer_lr > 0 and 0 <= outer_momentum < 1, got {outer_lr}, {outer_momentum}"
            )
        names = [name for name, _ in model.named_parameters()]
        self.codec: PseudogradientCodec | None = None
        self.error_feedback: ErrorFeedback | None = None
        if isinstance(compression, CompressionConfig):
            if compression.scheme != "none":
                self.codec = PseudogradientCodec.from_config(names, param_roles(model), compression)
                if compression.error_feedback:
                    self.error_feedback = ErrorFeedback(compression.ef_decay, compression.ef_alpha)
        elif isinstance(compression, Compressor):
            self.codec = PseudogradientCodec(names, [compression] * len(names))
        elif compression is not None:
            raise ValueError(
                "compression must be a muloco.compress compressor (get_compressor(...)) or a "
                f"CompressionConfig, got {type(compression).__name__}"
            )
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.backend = backend or LocalBackend()
        params = [p.data for p in model.parameters()]
        # Every process must call this broadcast at start so that all replicas begin identical.
        self.backend.broadcast(params, src=0).wait()
        device = params[0].device if params else torch.device("cpu")
        self.outer = OuterOptimizer(
            list(model.named_parameters()), outer_lr, outer_momentum, nesterov, device
        )
        self.local_step = 0
        self.outer_steps = 0
        self.last_update_norm: float | None = None

    def step(self) -> bool:
        """Count one inner step; on every `sync_every`-th call, synchronize. Returns True when it synced."""
        self.local_step += 1
        if self.local_step % self.sync_every != 0:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> float:
        """Average pseudogradients over processes, take the outer step, reset the model to the new global
        parameters. Every process must call it the same number of times. Returns the update norm."""
        params = list(self.model.parameters())
        delta = pseudogradient(self.outer.params, params)
        K = self.backend.world_size  # one replica per process
        if self.codec is None:
            delta = mean_uncompressed(self.backend, delta, K)
        else:
            message = self.codec.encode(delta, self.error_feedback)
            delta = mean_compressed(self.backend, self.codec, [message], K, self.outer.params)
        self.last_update_norm = self.outer.step(delta)
        for p, g in zip(params, self.outer.params, strict=True):
            p.copy_(g)
        self.outer_steps += 1
        return self.last_update_norm

    def state_dict(self) -> dict:
        return {
            "outer": self.outer.state_dict(),
            "local_step": self.local_step,
            "outer_steps": self.outer_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.outer.load_state_dict(state["outer"])
        self.local_step, self.outer_steps = state["local_step"], state["outer_steps"]
