"""The sync engine: everything between the replicas' inner steps and the next round (DiLoCo, Douillard et
al. 2023, Algorithm 1; Streaming DiLoCo, arXiv:2501.18512).

One sync of fragment p, in two halves so that Streaming DiLoCo can train on while it travels:

    start(p, replicas, step)   pseudogradients delta_k = theta_global - theta_k of the fragment (the guard
                               leaves non-finite replicas out), encoded with error feedback when compressed,
                               and the reducer's mean started                              -> InFlightSync
    finish(sync, replicas)     wait for the mean, outer Nesterov step on the fragment, merge into the
                               replicas (local <- alpha local + (1 - alpha) global)        -> SyncRecord

`due(step)` says which syncs to finish and which fragments to start after inner step `step`. The engine owns
the fp32 global copy and outer momentum, the fragments and their schedule, the codecs and error-feedback
buffers (one per local replica), the syncs in flight and the non-finite guard, and it books bytes in the
run's `CommLedger`. `muloco train` (trainer.py) and `muloco.DiLoCo` (diloco.py) both drive it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from muloco.comm import Backend
from muloco.comm.sharding import as_shard_of, local
from muloco.compress import Compressor, ErrorFeedback, NoCompression
from muloco.config import CompressionConfig, OuterConfig, SyncConfig
from muloco.errors import TrainingError, UserError
from muloco.models.roles import param_roles
from muloco.net.wan import sync_seconds
from muloco.run.state import CommLedger, Progress, WanProjection
from muloco.sync.codec import PseudogradientCodec
from muloco.sync.fragments import SyncSchedule, fragment_indices
from muloco.sync.guard import BadSyncGuard, usable
from muloco.sync.inflight import InFlightSync, SyncRecord
from muloco.sync.outer import OuterOptimizer
from muloco.sync.reduce import Contribution, Mean, Reducer
from muloco.sync.scatter import PartitionedCodec
from muloco.sync.transport import choose_transport

log = logging.getLogger("muloco")


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors taken as one vector (one host sync, not one per tensor)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).item()


def owner_feedback(
    compression: CompressionConfig | Compressor | None, transport: str
) -> ErrorFeedback | None:
    """A part owner's error feedback for its second quantization (reduce_scatter only): as
    compression.mean_error_feedback says, with the section's ef_decay / ef_alpha; on, with the defaults,
    for a bare compressor (the Python API)."""
    if transport != "reduce_scatter":
        return None
    if isinstance(compression, CompressionConfig):
        on = compression.mean_error_feedback
        return ErrorFeedback(compression.ef_decay, compression.ef_alpha) if on else None
    return ErrorFeedback()


def mean_compression(compression: CompressionConfig | Compressor | None):
    """The compression of the part owners' means (reduce_scatter): a section's second_stage_bits; a bare
    compressor (the Python API) compresses both stages."""
    if isinstance(compression, CompressionConfig):
        return compression.model_copy(update={"bits": compression.second_stage_bits})
    return compression


def build_codecs(
    model: nn.Module, fragments: list[list[int]], compression: CompressionConfig | Compressor | None
) -> list[PseudogradientCodec]:
    """One codec per fragment: a `compression:` section (skip rules as in `muloco train`), or one
    compressor for every parameter; none when uncompressed."""
    names = [name for name, _ in model.named_parameters()]
    if compression is None or getattr(compression, "scheme", None) == "none":
        return []
    if isinstance(compression, Compressor):
        return [PseudogradientCodec([names[i] for i in f], [compression] * len(f)) for f in fragments]
    roles = param_roles(model)
    return [PseudogradientCodec.from_config([names[i] for i in f], roles, compression) for f in fragments]


class SyncEngine:
    def __init__(
        self,
        model: nn.Module,
        reducer: Reducer,
        *,
        sync: SyncConfig,
        outer: OuterConfig,
        compression: CompressionConfig | Compressor | None,
        local_replicas: int,
        max_bad_syncs: int,
        total_steps: int | None = None,
        outer_device: torch.device | None = None,
        progress: Progress | None = None,
        ledger: CommLedger | None = None,
        wan: WanProjection | None = None,
        shard_group: Backend | None = None,
    ) -> None:
        """model: the initial (identical on every replica) parameters; total_steps: the run's length
        (None: open-ended, the Python API), whose last step syncs every fragment with unsynced steps.
        shard_group: sharding=fsdp, the worker's ranks. `model` is then the FSDP-wrapped replica and the
        engine holds this rank's rows of everything (sharding.py); norms, health and byte counts are
        summed over the group so that every rank of the worker decides alike."""
        self.shard_group = shard_group
        self.sharded_like = list(model.parameters()) if shard_group is not None else None  # DTensors
        named = [(name, local(p)) for name, p in model.named_parameters()]
        device = outer_device or (named[0][1].device if named else torch.device("cpu"))
        self.outer = OuterOptimizer(named, outer.lr, outer.momentum, outer.nesterov, device)
        try:
            self.fragments = fragment_indices([n for n, _ in named], sync)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        shapes = [[self.outer.params[i].shape for i in f] for f in self.fragments]
        self.codecs = build_codecs(model, self.fragments, compression)
        compressed = bool(self.codecs)
        self.aggregate, self.trim = sync.aggregate, sync.trim
        if self.aggregate != "mean" and not compressed:
            # A robust rule needs every contribution whole: fp32 messages, all-gathered (aggregate.py).
            names = [name for name, _ in named]
            self.codecs = [
                PseudogradientCodec([names[i] for i in f], [NoCompression()] * len(f)) for f in self.fragments
            ]
        self.transport = self._choose_transport(model, sync, compression, shapes, reducer, wan)
        ef = compression if isinstance(compression, CompressionConfig) else None
        with_ef = bool(ef and ef.error_feedback and compressed)
        self.error_feedback = [
            ErrorFeedback(ef.ef_decay, ef.ef_alpha) if with_ef else None for _ in range(local_replicas)
        ]
        # reduce_scatter: this process owns the parts of its replicas; the second quantization's buffers.
        self.owner_feedback = [owner_feedback(compression, self.transport) for _ in range(local_replicas)]
        self.schedule = SyncSchedule(sync.every, sync.fragments, sync.overlap)
        self.alpha, self.streaming = sync.alpha, sync.streaming
        self.reducer, self.total_steps = reducer, total_steps
        self.progress = progress or Progress()
        self.ledger = ledger or CommLedger(num_params=self.outer.num_params)
        self.wan = wan
        self.guard = BadSyncGuard(self.progress, reducer.workers, max_bad_syncs)
        self.observer = None  # diagnostics (alignment.py): sees every pseudogradient and merge
        self.conclusion: dict[str, Any] = {}  # the reducer's final agreement's summary fields (conclude)
        self.in_flight: list[InFlightSync] = []
        self.unsynced = [False] * len(self.fragments)  # inner steps not yet covered by a started sync
        reducer.open(shapes, self.codecs)

    def _choose_transport(self, model, sync, compression, shapes, reducer, wan) -> str:
        """sync.transport resolved among the reducer's transports (transport.py); reduce_scatter wraps each
        fragment's codec into K parts whose owners re-quantize the mean with `compression.mean_bits`."""
        workers = reducer.workers
        if not self.codecs:
            return choose_transport(sync.transport, workers, False, None, 0.0, 0.0)
        if sync.aggregate != "mean":
            return "all_gather"  # owners of parts cannot apply a rule that needs whole contributions
        mean_codecs = build_codecs(model, self.fragments, mean_compression(compression))
        message = sum(c.payload_bits(s) / 8 for c, s in zip(self.codecs, shapes, strict=True))
        mean = sum(c.payload_bits(s) / 8 for c, s in zip(mean_codecs, shapes, strict=True))
        link = wan.link if wan is not None else None
        # A reducer that does not declare its transports (a user's own, via the Python API) gets all_gather.
        supported = getattr(reducer, "transports", ("all_gather",))
        overlapped = sync.overlap > 0
        transport = choose_transport(
            sync.transport, workers, True, link, message, mean, supported, overlapped
        )
        if transport == "reduce_scatter" and self.shard_group is not None:
            transport = "all_gather"  # its part owners' buffers are per rank, not resharded (config.py)
        if transport == "reduce_scatter":
            self.codecs = [
                PartitionedCodec(c, s, workers, m.compressors)
                for c, s, m in zip(self.codecs, shapes, mean_codecs, strict=True)
            ]
        return transport

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.outer.params

    @property
    def fragment_syncs(self) -> int:
        return self.progress.fragment_syncs

    # -- the schedule ---------------------------------------------------------------------------------
    def next_event(self, step: int) -> int:
        """The next step at which a sync starts or an in-flight one is applied."""
        return min([self.schedule.next_start(step), *(s.apply_step for s in self.in_flight)])

    def trained(self) -> None:
        """The replicas took inner steps that no started sync covers yet."""
        self.unsynced = [True] * len(self.fragments)

    def due(self, step: int) -> tuple[list[InFlightSync], list[int]]:
        """After inner step `step`: the syncs in flight to finish now, then the fragments to start. At the
        run's last step every sync in flight finishes and every fragment with unsynced steps starts, so the
        final global parameters hold every worker's last steps."""
        last = self._is_last(step)
        finishing = [s for s in self.in_flight if last or s.apply_step <= step]
        if last:
            return finishing, [p for p, unsynced in enumerate(self.unsynced) if unsynced]
        return finishing, self.schedule.starting_at(step)

    def replan_if_moved(self, sync: InFlightSync, fragment: int, step: int, last: bool) -> list[int] | None:
        """None when `sync` is the one planned (fragment at step). Otherwise the reducer moved it (torchft:
        this worker adopted its quorum's state and step), so the plan for this step is void: the fragments
        still to start, which it joins with no replicas of its own (they hold the adopted state). At the
        run's last step the others go on to sync the later fragments; before it, none."""
        if (sync.fragment, sync.started_step) == (fragment, step):
            return None
        return list(range(sync.fragment + 1, len(self.fragments))) if last else []

    def delay(self, step: int) -> int:
        """tau, the inner steps a sync started at `step` travels; 0 at the last step."""
        return 0 if self._is_last(step) else self.schedule.overlap

    def _is_last(self, step: int) -> bool:
        return self.total_steps is not None and step >= self.total_steps

    # -- a sync ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def start(
        self,
        fragment: int,
        replicas: list,
        step: int,
        sums: dict[str, tuple[float, int]] | None = None,
        delay: int | None = None,
    ) -> InFlightSync:
        """The fragment's pseudogradients, compressed, and their mean started, to be applied `delay` steps
        later (default: tau, 0 at the run's last step). Every process calls this for the same fragments in
        the same order (the reducer's collectives). `sums`: the caller's (sum, count) pairs to report with
        the sync (e.g. the round's train losses)."""
        indices = self.fragments[fragment]
        codec = self.codecs[fragment] if self.codecs else None
        like = [self.outer.params[i] for i in indices]
        numel = sum(p.numel() for p in like)

        # Uncompressed: summed over this process's replicas. Compressed: each replica encodes its own
        # message, exactly what a node would send. The sum of unit vectors gives the mean pairwise cosine:
        # sum_{j!=k} u_j.u_k = |sum u|^2 - k.
        with record_function("muloco::pseudogradients"):
            delta_sum = [torch.zeros_like(p) for p in like] if codec is None else None
            unit_sum = [torch.zeros_like(p) for p in like] if len(replicas) > 1 else None
            norms, messages = [], []
            for position, replica in enumerate(replicas):
                replica.activate()
                delta = replica.pseudogradient(self.outer.params, indices)
                norm = global_norm(delta)
                if self.shard_group is not None:  # every rank of the worker judges the replica alike
                    sq, unhealthy = self.worker_sum(norm**2, float(not replica.healthy))
                    norm, replica.healthy = math.sqrt(sq), unhealthy == 0
                if not usable(replica, norm):
                    self._reset(position, replica, step, norm)
                    continue
                norms.append(norm)
                if unit_sum is not None:
                    torch._foreach_add_(unit_sum, delta, alpha=1.0 / max(norm, 1e-30))
                if codec is None:
                    torch._foreach_add_(delta_sum, delta)
                else:
                    messages.append(codec.encode(delta, self.error_feedback[position]))
                if self.observer is not None:
                    self.observer.observe(delta)
                del delta
                replica.deactivate()
        self.unsynced[fragment] = False
        healthy = len(norms)
        payload = (
            4.0 * numel if codec is None else (sum(map(len, messages)) / len(messages) if messages else 0.0)
        )
        delay = self.delay(step) if delay is None else delay
        with record_function("muloco::reduce"):
            contribution = Contribution(
                fragment,
                step,
                healthy,
                like,
                payload,
                delta_sum,
                messages,
                codec,
                self.owner_feedback,
                self.aggregate,
                self.trim,
                step + delay,
                absent=not replicas,
            )
            # A reducer that exchanges before it returns (torchft, a sync applied at once) waits here.
            t0 = time.perf_counter()
            pending = self.reducer.start_mean(contribution)
            self.ledger.comm_wait_s += time.perf_counter() - t0
        if pending.moved_to is not None:
            # This worker was behind the quorum (torchft) and adopted a member's state, replicas and step
            # included: the sync is the quorum's (its fragment, start and apply steps), without this
            # worker's pseudogradients.
            moved = pending.moved_to
            fragment, step, delay = moved.fragment, moved.step, moved.apply_step - moved.step
            like, norms, unit_sum, payload = (
                [self.outer.params[i] for i in self.fragments[fragment]],
                [],
                None,
                0.0,
            )
        # Collectives: known now (a swarm's when its group is). Sharded: the worker's = its ranks' sum.
        payload, sent, numel = self.worker_sum(payload, pending.bytes_sent, numel)
        self.ledger.count(sent, pending.bytes_sent)
        if payload:
            self.ledger.payload_by_fragment[fragment] = payload
        if self.wan is not None and self.wan.link is not None:
            K = self.reducer.workers or 1
            self.wan.project(sync_seconds(self.wan.link, payload, K, self.transport), delay)

        cosine = None
        if unit_sum is not None and healthy > 1:
            cosine = (global_norm(unit_sum) ** 2 - healthy) / (healthy * (healthy - 1))
        stats: dict[str, Any] = {
            "norm_sum_count": (sum(norms), len(norms)),
            "pseudograd_cosine": cosine,
            "payload_bytes": payload,
            "bits_per_param": round(8 * payload / numel, 4) if payload else None,
            "alignment": self.observer.stats(like) if self.observer is not None else {},
            **(sums or {}),
        }
        sync = InFlightSync(fragment, step, step + delay, pending, stats)
        self.in_flight.append(sync)
        return sync

    def _reset(self, position: int, replica, step: int, norm: float) -> None:
        """Left out of this sync (the mean is over the healthy replicas) and restarted from the global
        parameters with a fresh inner state and error-feedback buffer (they may hold the NaN)."""
        log.warning(
            "replica=%d step=%d: non-finite loss or pseudogradient (norm %s): left out of this sync and "
            "reset to the global parameters",
            replica.index,
            step,
            norm,
        )
        replica.reset_to(self.outer.params)
        if self.error_feedback[position] is not None:
            self.error_feedback[position].reset()
        replica.deactivate()

    @torch.no_grad()
    def finish(self, sync: InFlightSync, replicas: list) -> SyncRecord:
        """Wait for the mean (blocks up to the reducer's timeout), take the outer step on the fragment,
        merge it into the replicas. Then the reducer's `after_sync`: a swarm peer that fell behind may spend
        seconds there and replace the global state and the counters with the swarm's (the record keeps the
        step the sync was applied at)."""
        t0 = time.perf_counter()
        mean: Mean = sync.result.wait()
        self.ledger.comm_wait_s += time.perf_counter() - t0
        self.in_flight.remove(sync)
        if mean.dropped:
            # The reducer gave the sync up: no outer step, nothing counted, and the replicas keep their
            # drift, which the fragment's next sync carries.
            self.ledger.count(mean.bytes_sent)  # torchft: never sharded
            self.unsynced[sync.fragment] = True
            # The residuals kept what that message left out, as if it had arrived; the next sync resends
            # the whole drift, so they would count it twice.
            names = [self.outer.names[i] for i in self.fragments[sync.fragment]]
            for ef in self.error_feedback:
                if ef is not None:
                    ef.forget(names)
            return self._record(sync, mean, None, 0)
        indices = self.fragments[sync.fragment]

        # Outer Nesterov step on the fragment's fp32 global parameters (its own momentum buffers). Never
        # with a non-finite value: without a finite mean the step is skipped.
        # No mean at all (a swarm peer without a group, or behind it) is not divergence; a mean that
        # overflowed from finite inputs is.
        finite = mean.values is not None and math.isfinite(global_norm(mean.values))
        overflowed = mean.values is not None and not finite
        left_out = mean.left_out
        if self.shard_group is not None:
            # Each rank holds its rows of the mean, decoded from its own sync group's messages: the worker
            # steps only if every rank has finite rows, and counts what any rank left out.
            R = self.shard_group.world_size
            unusable, left, bad = self.worker_sum(float(not finite), float(mean.left_out), float(overflowed))
            finite, left_out, overflowed = unusable == 0, math.ceil(left / R), bad > 0
        update_norm = None
        if finite:
            with record_function("muloco::outer_step"):
                update_norm = self.outer.step(mean.values, None if len(self.fragments) == 1 else indices)
            if self.shard_group is not None:
                update_norm = math.sqrt(self.worker_sum(update_norm**2)[0])
        left_out = max(left_out, 1) if overflowed else left_out
        self.guard.record(left_out, f"sync of fragment {sync.fragment} at step {self.progress.steps}")
        for kind, count in mean.excluded.items():
            self.progress.excluded[kind] = self.progress.excluded.get(kind, 0) + count
        self.progress.fragment_syncs += 1
        self.progress.outer_steps = self.progress.fragment_syncs // len(self.fragments)
        if mean.bytes_sent or self.shard_group is not None:
            (sent,) = self.worker_sum(mean.bytes_sent)
            self.ledger.count(sent, mean.bytes_sent)

        # Merge: local <- alpha local + (1 - alpha) global (alpha = 0: restart from the global ones).
        for replica in replicas:
            if len(self.fragments) == 1 and self.alpha == 0.0:
                replica.load_global(self.outer.params)
            else:
                replica.merge_global(self.outer.params, indices, self.alpha)
        if self.alpha > 0:
            self.unsynced[sync.fragment] = True  # the replicas keep part of their own drift
        if self.observer is not None:
            self.observer.restart_from(self.outer.params)

        record = self._record(sync, mean, update_norm, left_out)
        self.reducer.after_sync(self, mean, replicas)
        return record

    def worker_sum(self, *values: float) -> list[float]:
        """Sums over the worker's ranks when sharded (one small all-reduce, a collective of the worker's
        ranks); the values otherwise."""
        if self.shard_group is None:
            return list(values)
        total = self.shard_group.all_reduce_sum([torch.tensor(values, dtype=torch.float64)]).wait()[0]
        return total.tolist()

    def _record(self, sync: InFlightSync, mean: Mean, update_norm: float | None, left_out: int) -> SyncRecord:
        stats = sync.stats
        fields = {
            "pseudograd_cosine": stats["pseudograd_cosine"],
            "outer_update_norm": update_norm,
            "outer_step": self.progress.outer_steps,
            "replicas_left_out": left_out,
            **({"contributions_excluded": mean.excluded} if mean.excluded else {}),
            "payload_bytes": stats["payload_bytes"],
            "bits_per_param": stats["bits_per_param"],
            **stats["alignment"],
            **({"fragment": sync.fragment, "started_step": sync.started_step} if self.streaming else {}),
            **mean.details,
        }
        sums = {k: tuple(v) for k, v in stats.items() if k.endswith("_sum_count")}
        return SyncRecord(
            sync.fragment, sync.started_step, self.progress.steps, self.progress.outer_steps, fields, sums
        )

    # -- joining and leaving the run, shared state (a swarm joiner's catch-up) ------------------------
    def join(self, replicas: list, resumed: bool) -> None:
        """Before the first round: the reducer joins the run (a swarm joiner loads the swarm's state)."""
        self.reducer.join(self, replicas, resumed)

    def conclude(self, replicas: list, on_failure: Callable[[], Any]) -> None:
        """After the run's last sync: the reducer's final agreement (a swarm's peers compare their models
        and a minority adopts the majority's; its summary.json fields are kept in `conclusion`). If it
        fails, on_failure() first (a checkpoint of this worker's own state: no work is lost), then the
        error."""
        try:
            self.conclusion = self.reducer.conclude(self, replicas)
        except TrainingError:
            on_failure()
            raise

    def close(self) -> None:
        self.reducer.close()

    def export_state(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        p = self.progress
        meta = {"step": p.steps, "outer_steps": p.outer_steps, "fragment_syncs": p.fragment_syncs}
        return [*self.outer.params, *self.outer.momentum_buffers], meta

    def adopt_state(self, tensors: list[torch.Tensor], meta: dict[str, int], replicas: list) -> None:
        n = len(self.outer.params)
        self.outer.load_state_dict(
            {"names": self.outer.names, "params": tensors[:n], "momentum_buffers": tensors[n:]}
        )
        p = self.progress
        p.steps, p.outer_steps, p.fragment_syncs = meta["step"], meta["outer_steps"], meta["fragment_syncs"]
        p.round_losses = []
        for replica in replicas:
            replica.load_global(self.outer.params)
            replica.inner_steps = p.steps
        self.unsynced = [False] * len(self.fragments)  # the replicas hold no steps of their own yet
        # Error-feedback residuals were left by messages encoded from the old global parameters.
        for ef in (*self.error_feedback, *self.owner_feedback):
            if ef is not None:
                ef.reset()

    def can_adopt(self) -> bool:
        return not self.in_flight and not self._is_last(self.progress.steps)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Sharded: every tensor of a parameter's rows as a DTensor laid out like the parameter, so that a
        sharded checkpoint (sharded_checkpoint.py) can resume with another R."""
        state = {
            "outer": self.outer.state_dict(),
            "error_feedback": [ef.state_dict() if ef is not None else None for ef in self.error_feedback],
            "owner_error_feedback": [
                ef.state_dict() if ef is not None else None for ef in self.owner_feedback
            ],
            "in_flight": [s.state_dict() for s in self.in_flight],
            "unsynced": list(self.unsynced),
        }
        if self.sharded_like is not None:
            self._as_shards(state)
        return state

    def _as_shards(self, state: dict[str, Any]) -> None:
        like, index = self.sharded_like, {name: i for i, name in enumerate(self.outer.names)}
        outer = state["outer"] = dict(state["outer"])
        for key in ("params", "momentum_buffers"):
            outer[key] = [as_shard_of(t, p) for t, p in zip(outer[key], like, strict=True)]
        for ef in state["error_feedback"]:
            if ef is not None:
                ef["buffers"] = {n: as_shard_of(t, like[index[n]]) for n, t in ef["buffers"].items()}
        for sync in state["in_flight"]:
            values = sync["mean"]["values"]
            if values is not None:
                shards = [like[i] for i in self.fragments[sync["fragment"]]]
                sync["mean"]["values"] = [as_shard_of(t, p) for t, p in zip(values, shards, strict=True)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = _local_rows(state)  # a sharded checkpoint's DTensors: this rank's rows
        self.outer.load_state_dict(state["outer"])
        owner = state.get("owner_error_feedback", [None] * len(self.owner_feedback))  # none before transports
        for buffers, states in ((self.error_feedback, state["error_feedback"]), (self.owner_feedback, owner)):
            for ef, ef_state in zip(buffers, states, strict=True):
                if ef is not None and ef_state is not None:
                    ef.load_state_dict(ef_state)
        self.in_flight = [InFlightSync.from_state_dict(s) for s in state["in_flight"]]
        for sync in self.in_flight:  # a checkpoint loads on the CPU: a mean goes where the outer step is
            mean = sync.result.wait()
            if mean.values is not None:
                mean.values = [v.to(self.outer.device) for v in mean.values]
        self.unsynced = list(state["unsynced"])


def _local_rows(value: Any) -> Any:
    """`value` with every DTensor replaced by this rank's rows (sharding.local)."""
    if isinstance(value, dict):
        return {k: _local_rows(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local_rows(v) for v in value]
    return local(value) if isinstance(value, torch.Tensor) else value
