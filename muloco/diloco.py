"""`DiLoCo`: DiLoCo/MuLoCo around a user's own model and training loop (in the spirit of
torchft.local_sgd.DiLoCo), on the same sync engine as `muloco train` (muloco/sync/).

    diloco = DiLoCo(model, inner_optimizer, sync_every=30)
    for x, y in data:
        loss = loss_fn(model(x), y); loss.backward()
        inner_optimizer.step(); inner_optimizer.zero_grad()
        diloco.step(loss)      # at sync events: average pseudogradients, outer Nesterov step, merge

Each process holds one replica; the backend averages over processes (None: this process alone, K = 1), or
over the peers of a hivemind swarm (a `HivemindBackendConfig`). Streaming DiLoCo: `fragments` (P) sync in
turn, each applied `overlap` (tau) steps after it starts and merged with `alpha`. `compression` is a
`muloco.compress` compressor (every parameter) or a `compression:` config section (skip rules and error
feedback as in `muloco train`). A non-finite loss or pseudogradient leaves this replica out of a sync and
restarts it from the global parameters. `state_dict()` holds everything needed to resume exactly: global
parameters, outer momentum, error-feedback buffers, syncs in flight, counters.
"""

from __future__ import annotations

import math

import pydantic
import torch
from torch import nn

from muloco.comm import Backend, LocalBackend
from muloco.comm.aggregate import tolerated
from muloco.compress import Compressor
from muloco.config import CompressionConfig, HivemindBackendConfig, OuterConfig, SyncConfig
from muloco.errors import UserError
from muloco.run.replica import Replica
from muloco.sync import CollectiveReducer, Reducer, SyncEngine, SyncRecord
from muloco.sync.counters import CommLedger, Progress

STATE_FORMAT = 2  # of state_dict(): 2 = the engine's state, progress and ledger (1: outer and counters)


def _reducer_for(backend: Backend | HivemindBackendConfig | Reducer | None, tolerate: int = 0) -> Reducer:
    if backend is None:
        return CollectiveReducer.over(LocalBackend())
    if isinstance(backend, HivemindBackendConfig):
        from muloco.sync.swarm import SwarmReducer

        return SwarmReducer(backend, tolerate=tolerate)
    if hasattr(backend, "start_mean"):
        return backend  # a Reducer
    if hasattr(backend, "all_reduce_sum"):
        return CollectiveReducer.over(backend)
    raise ValueError(
        "backend must be None (this process alone), a muloco.comm Backend (e.g. TorchDistBackend()), a "
        f"muloco.config.HivemindBackendConfig, or a reducer; got {type(backend).__name__}"
    )


def _section(cls, **values):
    """A config section built from keyword arguments: the same checks as the YAML keys, named after the
    argument on failure."""
    try:
        return cls(**values)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(x) for x in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise ValueError(f"DiLoCo({where}=...): {message}" if where else f"DiLoCo: {message}") from None


class DiLoCo:
    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        backend: Backend | HivemindBackendConfig | Reducer | None = None,
        compression: Compressor | CompressionConfig | None = None,
        fragments: int = 1,
        overlap: int = 0,
        alpha: float = 0.0,
        *,
        total_steps: int | None = None,
        max_bad_syncs: int = 3,
        transport: str = "auto",
        aggregate: str = "mean",
        trim: int = 1,
        eager: bool = False,
    ) -> None:
        """total_steps: when given, the step() call that reaches it syncs every fragment with unsynced
        steps at once, as `muloco train` ends a run; max_bad_syncs: syncs in a row with this replica left
        out (non-finite) before TrainingError; transport: how compressed syncs travel (sync.transport:
        all_gather, reduce_scatter or auto; reduce_scatter needs collectives, not a swarm); aggregate, trim:
        how a sync combines the contributions (sync.aggregate, sync.trim: mean, sender_mean, trimmed_mean,
        median, centered_clip; docs/security.md); eager: eager updates of an overlapped sync (sync.eager,
        docs/streaming.md)."""
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(
                f"sync_every must be an integer >= 1 (H, inner steps between syncs), got {sync_every}"
            )
        sync = _section(
            SyncConfig,
            every=sync_every,
            fragments=fragments,
            overlap=overlap,
            alpha=alpha,
            transport=transport,
            aggregate=aggregate,
            trim=trim,
            eager=eager,
        )
        outer = _section(OuterConfig, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        if compression is not None and not isinstance(compression, Compressor | CompressionConfig):
            raise ValueError(
                "compression must be a muloco.compress compressor (get_compressor(...)) or a "
                f"CompressionConfig, got {type(compression).__name__}"
            )
        self.model, self.inner_optimizer = model, inner_optimizer
        reducer = _reducer_for(backend, tolerated(aggregate, trim))
        params = [p.data for p in model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        if isinstance(reducer, CollectiveReducer):
            # Every process must call this broadcast at start so that all replicas begin identical.
            reducer.topology.sync.broadcast(params, src=0).wait()
        self.replica = Replica(getattr(backend, "rank", 0), model, inner_optimizer, None, device)
        self.progress = Progress()
        self.ledger = CommLedger(num_params=sum(p.numel() for p in params))
        try:
            self.engine = SyncEngine(
                model,
                reducer,
                sync=sync,
                outer=outer,
                compression=compression,
                local_replicas=1,
                max_bad_syncs=max_bad_syncs,
                total_steps=total_steps,
                progress=self.progress,
                ledger=self.ledger,
            )
        except UserError as exc:  # more fragments than blocks; reduce_scatter or a whole window on a swarm
            named = {
                "overlap": f"overlap={overlap}",
                "eager": f"eager={eager}",
                "fragment": f"fragments={fragments}",
            }
            argument = next((a for key, a in named.items() if key in str(exc)), f"transport={transport!r}")
            raise ValueError(f"DiLoCo({argument}): {exc}") from None
        self.last_update_norm: float | None = None
        self.records: list[SyncRecord] = []  # the syncs applied by the latest step() or sync()
        # A loss that is not finite, kept on the loss's device: reading it every step would be a host sync.
        self._non_finite: torch.Tensor | bool = False
        self._joined, self._resumed = False, False

    @property
    def outer_steps(self) -> int:
        return self.progress.outer_steps

    @property
    def local_step(self) -> int:
        return self.progress.steps

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global parameters (the model holds them after a plain DiLoCo sync)."""
        return self.engine.global_params

    @torch.no_grad()
    def step(self, loss: float | torch.Tensor | None = None) -> bool:
        """Count one inner step (pass its loss to have a non-finite one leave this replica out of the
        next sync); at a sync event the engine's round applies the syncs due and starts the ones
        scheduled. Every process must call it the same number of times: syncs are collectives. Returns True
        when a sync was applied."""
        self._join()
        if isinstance(loss, torch.Tensor):
            self._non_finite = ~torch.isfinite(loss.detach()).all() | self._non_finite
        elif loss is not None and not math.isfinite(loss):
            self._non_finite = True
        step = self.progress.steps + 1
        self.replica.inner_steps = step
        self.records = self.engine.round(step, [self.replica], before_start=self._check_losses)
        return self._applied()

    def _join(self) -> None:
        """Join the run before the first step (after a `load_state_dict`, as a resumed member): a swarm
        joiner loads the swarm's state; collectives do nothing."""
        if not self._joined:
            self.engine.join([self.replica], resumed=self._resumed)
            self._joined = True

    def _check_losses(self) -> None:
        """Before pseudogradients are read: a non-finite loss since the last sync leaves this replica out
        (one host sync per sync, not per step)."""
        if bool(self._non_finite):
            self.replica.healthy = False
        self._non_finite = False

    @torch.no_grad()
    def sync(self) -> float | None:
        """Sync now: every fragment synced at once (tau = 0) and every sync in flight applied (a
        fragment's after its new one starts, so no inner step is lost). Every process must call it at the
        same point. Returns the norm of the last outer update."""
        self._join()
        step = self.progress.steps
        self.records = self.engine.round(step, [self.replica], before_start=self._check_losses, now=True)
        self._applied()
        return self.last_update_norm

    def _applied(self) -> bool:
        if self.records:
            self.last_update_norm = self.records[-1].fields["outer_update_norm"]
        return bool(self.records)

    def state_dict(self) -> dict:
        """Global parameters, outer momentum, error-feedback buffers, syncs in flight (their means), and
        the counters: with the model's and inner optimizer's own state_dicts, a resume is exact."""
        return {
            "format": STATE_FORMAT,
            "engine": self.engine.state_dict(),
            "progress": self.progress.state_dict(),
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s output; call it before the first step() to resume (a swarm member then
        joins as a resumed peer and serves this state, rather than loading the swarm's)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            version = state.get("format", "1 (muloco <= 0.1)") if isinstance(state, dict) else "unknown"
            raise ValueError(
                f"DiLoCo.load_state_dict: a state of format {version}, this muloco reads format "
                f"{STATE_FORMAT}; resume with the muloco that saved it, or start from the model's weights"
            )
        if self._joined:
            raise RuntimeError("DiLoCo.load_state_dict must come before the first step() or sync()")
        if ("eager" in state["engine"]) != (self.engine.eager is not None):
            saved = "eager" in state["engine"]
            raise ValueError(
                f"DiLoCo.load_state_dict: a state saved with eager={saved} into DiLoCo(eager={not saved}); "
                f"resume with eager={saved}"
            )
        self._resumed = True
        self.engine.load_state_dict(state["engine"])
        self.progress.load_state_dict(state["progress"])
        self.ledger.load_state_dict(state["ledger"])
        self.replica.inner_steps = self.progress.steps

    def close(self) -> None:
        """Leave the swarm (hivemind); nothing to do for collectives, whose backend the caller owns."""
        self.engine.close()
