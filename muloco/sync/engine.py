"""The sync engine: everything between the replicas' inner steps and the next round (DiLoCo, Douillard et
al. 2023, Algorithm 1; Streaming DiLoCo, arXiv:2501.18512). `muloco train` (run/trainer.py) and
`muloco.DiLoCo` (diloco.py) both call one method, `round`, after their inner steps; neither knows the
protocol it runs:

    round(step, replicas)      the sync event after inner step `step`:
      1. apply the syncs in flight that are due (at the run's last step: all of them); one whose
         fragment starts again now (tau = H) right after that fragment's new sync starts
      2. start the fragments scheduled now (at the last step: every one with unsynced steps), each
         applied at once when tau = 0, and follow a torchft quorum that moved this worker
    start(p, replicas, step)   pseudogradients delta_k = theta_global - theta_k of fragment p (the guard
                               leaves non-finite replicas out), encoded with error feedback when compressed,
                               and the reducer's mean started                              -> InFlightSync
    finish(sync, replicas)     wait for the mean, outer Nesterov step on the fragment, merge into the
                               replicas (local <- alpha local + (1 - alpha) global)        -> SyncRecord

The engine owns the fp32 global copy and outer momentum, the fragments (fragments.py: their parameters,
codec, schedule slot and unsynced steps), the error-feedback buffers (one per local replica), the syncs in
flight and the non-finite guard, and it books steps and bytes in the run's counters (counters.py).
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
from muloco.compress import Compressor, ErrorFeedback
from muloco.config import CompressionConfig, OuterConfig, SyncConfig
from muloco.errors import TrainingError, UserError
from muloco.net.wan import sync_seconds
from muloco.sharding import local
from muloco.sync.counters import CommLedger, Progress, WanProjection
from muloco.sync.eager import EagerUpdates
from muloco.sync.engine_state import (
    adopt_shared_state,
    engine_state,
    export_shared_state,
    load_engine_state,
)
from muloco.sync.fragments import Fragment, SyncSchedule, fragment_indices
from muloco.sync.gather import Gathered, gather, global_norm
from muloco.sync.guard import BadSyncGuard
from muloco.sync.inflight import InFlightSync, SumCount, SyncRecord
from muloco.sync.messages import owner_feedback, plan_messages
from muloco.sync.outer import OuterOptimizer
from muloco.sync.reduce import Contribution, Mean, PendingMean, Reducer, check_whole_window

log = logging.getLogger("muloco")


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
            groups = fragment_indices(self.outer.names, sync)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        check_whole_window(reducer, sync)
        shapes = [[self.outer.params[i].shape for i in group] for group in groups]
        link = wan.link if wan is not None else None
        plan = plan_messages(model, groups, shapes, compression, sync, reducer, link, shard_group is not None)
        self.transport = plan.transport
        self.schedule = SyncSchedule(sync.every, sync.fragments, sync.overlap)
        self.fragments = [
            Fragment(p, group, self.outer, plan.codecs[p] if plan.codecs else None, self.schedule.offset(p))
            for p, group in enumerate(groups)
        ]
        ef = compression if isinstance(compression, CompressionConfig) else None
        with_ef = bool(ef and ef.error_feedback and plan.compressed)
        self.error_feedback = [
            ErrorFeedback(ef.ef_decay, ef.ef_alpha) if with_ef else None for _ in range(local_replicas)
        ]
        # reduce_scatter: this process owns the parts of its replicas; the second quantization's buffers.
        self.owner_feedback = [owner_feedback(compression, self.transport) for _ in range(local_replicas)]
        self.aggregate, self.trim = sync.aggregate, sync.trim
        self.alpha, self.streaming = sync.alpha, sync.streaming
        self.reducer, self.total_steps = reducer, total_steps
        self.progress = progress or Progress()
        self.ledger = ledger or CommLedger(num_params=self.outer.num_params)
        self.wan = wan
        self.guard = BadSyncGuard(self.progress, reducer.workers, max_bad_syncs)
        self.observer = None  # diagnostics (run/alignment.py): sees every pseudogradient and merge
        self.contribution_weight: Callable[[int, int], float] | None = None  # weight_by_tokens (pacing.py)
        self.conclusion: dict[str, Any] = {}  # the reducer's final agreement's summary fields (conclude)
        self.in_flight: list[InFlightSync] = []
        workers = reducer.workers or 1
        self.eager = EagerUpdates(self.outer, local_replicas, workers) if sync.eager else None  # eager.py
        self._settling = False  # the round applies everything (the run's end, now): eager replicas merge
        reducer.open(shapes, plan.codecs)

    @property
    def global_params(self) -> list[torch.Tensor]:
        return self.outer.params

    def base_of(self, position: int) -> list[torch.Tensor]:
        """What local replica `position`'s pseudogradient is taken against: the global parameters, or
        under eager updates its worker's own outer parameters."""
        return self.outer.params if self.eager is None else self.eager.base(position)

    @property
    def fragment_syncs(self) -> int:
        return self.progress.fragment_syncs

    # -- the round ------------------------------------------------------------------------------------
    @torch.no_grad()
    def round(
        self,
        step: int,
        replicas: list,
        *,
        round_loss: Callable[[], SumCount] | None = None,
        before_start: Callable[[], None] | None = None,
        now: bool = False,
    ) -> list[SyncRecord]:
        """The sync event after the replicas' inner steps up to `step` (every call trains some): the
        records of the syncs it applied, in order. Every process calls it at the same steps (the syncs are
        collectives). round_loss(): the train losses to report with the next sync started (the caller's,
        taken once per start); before_start(): called once before the first start (the Python API reads
        its losses' health there); now: sync now (DiLoCo.sync), every fragment synced at once (tau = 0) and
        every sync in flight applied."""
        self.progress.steps = step
        for fragment in self.fragments:
            fragment.unsynced = True  # the replicas took inner steps that no started sync covers yet
        final = now or self._is_last(step)
        self._settling = final
        try:
            return self._round(step, replicas, round_loss, before_start, now, final)
        finally:
            self._settling = False

    def _round(self, step, replicas, round_loss, before_start, now: bool, final: bool) -> list[SyncRecord]:
        records = []
        if now:
            starting = list(range(len(self.fragments)))
        elif final:
            starting = [f.index for f in self.fragments if f.unsynced]
        else:
            starting = self.schedule.starting_at(step)
        due = [s for s in self.in_flight if final or s.apply_step <= step]
        # With a whole window overlapped (tau = H) or eager updates the replicas restart at every sync's
        # start, so a due sync of a fragment that starts again now is applied once the new pseudogradient
        # is taken, against the parameters the window started from, and before its mean starts: the merge
        # after the outer step does not discard the window's steps (the naive delayed update: Kale et al.
        # 2025, arXiv 2502.12996), and a torchft quorum, formed as the mean starts, hands over a whole state
        # (no sync in flight). With tau < H the replicas still hold what the due sync sent: it is applied
        # first (Streaming DiLoCo's merge).
        restarts = self.schedule.overlap >= self.schedule.every or self.eager is not None
        after_start = {s.fragment: s for s in due if restarts and s.fragment in starting}

        # 1. Syncs in flight that are due are applied first (at the end: all of them).
        for sync in due:
            if sync.fragment not in after_start:
                records.append(self.finish(sync, replicas))

        # 2. The fragments scheduled now start theirs (at the run's last step: every fragment with unsynced
        #    steps; now: every fragment); a sync due at once (tau = 0) is applied at once.
        if starting and before_start is not None:
            before_start()
        contributing = replicas
        while starting:
            fragment, starting = starting[0], starting[1:]
            at = self.progress.steps  # a moved sync (below) set it to the quorum's
            loss = round_loss() if round_loss is not None else SumCount()
            due_now = after_start.pop(fragment, None)

            def apply_due(due: InFlightSync | None = due_now) -> None:
                records.append(self.finish(due, replicas))

            sync = self.start(
                fragment,
                contributing,
                at,
                loss,
                delay=0 if now else None,
                before_mean=None if due_now is None else apply_due,
            )
            first_of_window = self.schedule.overlap >= self.schedule.every and self.eager is None
            if due_now is None and first_of_window and not final:
                # A whole window's first sync: no mean has arrived to apply, and the replicas restart from
                # the global parameters all the same (the delayed update's first, empty outer step).
                self._merge(self.fragments[fragment], contributing)
            if self.eager is not None and not final:  # each worker's outer step at once (eager.py)
                self.eager.step(self.fragments[fragment].indices, contributing)
            if sync.apply_step <= self.progress.steps:
                records.append(self.finish(sync, replicas))
            # 3. torchft: this worker adopted its quorum's state and step, and joined the quorum's sync
            #    instead of the one planned: the plan for this step is void. At the end the others go on
            #    to sync the later fragments, which it joins with nothing of its own (its replicas hold the
            #    adopted state); before it, none.
            if (sync.fragment, sync.started_step) != (fragment, at):
                last = now or self._is_last(at)
                starting = list(range(sync.fragment + 1, len(self.fragments))) if last else []
                contributing = []
        for sync in after_start.values():  # a moved plan left its fragment out: applied all the same
            records.append(self.finish(sync, replicas))
        if final and self.eager is not None:
            self.eager.settle()
        return records

    def next_event(self, step: int) -> int:
        """The next step at which a sync starts or an in-flight one is applied."""
        return min([self.schedule.next_start(step), *(s.apply_step for s in self.in_flight)])

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
        loss: SumCount | None = None,
        delay: int | None = None,
        before_mean: Callable[[], None] | None = None,
    ) -> InFlightSync:
        """Fragment `fragment`'s pseudogradients, compressed, and their mean started, to be applied `delay`
        steps later (default: tau, 0 at the run's last step). Every process calls this for the same
        fragments in the same order (the reducer's collectives). `loss`: the caller's train losses to
        report with the sync; `before_mean`: called between the two (round: a due sync applied)."""
        part = self.fragments[fragment]
        delay = self.delay(step) if delay is None else delay
        with record_function("muloco::pseudogradients"):
            gathered = gather(part, replicas, step, self)
        part.unsynced = False
        if before_mean is not None:
            before_mean()
        with record_function("muloco::reduce"):
            pending = self._start_mean(part, gathered, step, step + delay, absent=not replicas)
        payload, norms, cosine = gathered.payload_bytes(), gathered.norms, gathered.cosine()
        if pending.moved_to is not None:
            # This worker was behind the quorum (torchft) and adopted a member's state, replicas and step
            # included: the sync is the quorum's (its fragment, start and apply steps), without this
            # worker's pseudogradients.
            moved = pending.moved_to
            part, step, delay = self.fragments[moved.fragment], moved.step, moved.apply_step - moved.step
            payload, norms, cosine = 0.0, [], None
        payload, numel = self._book(part, payload, pending, delay)
        fields = {
            "pseudograd_cosine": cosine,
            "payload_bytes": payload,
            "bits_per_param": round(8 * payload / numel, 4) if payload else None,
            **(self.observer.stats(part.params) if self.observer is not None else {}),
        }
        norm = SumCount(sum(norms), len(norms))
        sync = InFlightSync(part.index, step, step + delay, pending, loss or SumCount(), norm, fields)
        self.in_flight.append(sync)
        return sync

    def _start_mean(
        self, part: Fragment, gathered: Gathered, step: int, apply_step: int, absent: bool
    ) -> PendingMean:
        """The reducer's mean of this process's contribution, started. A reducer that exchanges before it
        returns (torchft, a sync applied at once) waits here: time on the network."""
        contribution = Contribution(
            fragment=part.index,
            step=step,
            healthy=gathered.healthy,
            like=part.params,
            payload_bytes=gathered.payload_bytes(),
            delta_sum=gathered.delta_sum,
            messages=gathered.messages,
            codec=part.codec,
            owner_feedback=self.owner_feedback,
            aggregate=self.aggregate,
            trim=self.trim,
            apply_step=apply_step,
            absent=absent,
        )
        t0 = time.perf_counter()
        pending = self.reducer.start_mean(contribution)
        self.ledger.comm_wait_s += time.perf_counter() - t0
        return pending

    def _book(self, part: Fragment, payload: float, pending: PendingMean, delay: int) -> tuple[float, int]:
        """The bytes a collective sends, known now (a swarm's when its group is), and the sync's time on
        the configured WAN link. Sharded: the worker's message is its ranks' sum. Returns the worker's
        message and the fragment's parameter count."""
        payload, sent, numel = self.worker_sum(payload, pending.bytes_sent, part.numel)
        self.ledger.count(sent, pending.bytes_sent)
        if payload:
            self.ledger.payload_by_fragment[part.index] = payload
        if self.wan is not None and self.wan.link is not None:
            K = self.reducer.workers or 1
            self.wan.project(sync_seconds(self.wan.link, payload, K, self.transport), delay)
        return payload, int(numel)

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
        part = self.fragments[sync.fragment]
        if mean.dropped:
            # The reducer gave the sync up: no outer step, nothing counted, and the replicas keep their
            # drift, which the fragment's next sync carries.
            self.ledger.count(mean.bytes_sent)  # torchft: never sharded
            part.unsynced = True
            # The residuals kept what that message left out, as if it had arrived; the next sync resends
            # the whole drift, so they would count it twice.
            for ef in self.error_feedback:
                if ef is not None:
                    ef.forget(part.names)
            if self.eager is not None:  # no mean: the next proxy has nothing stale to replace
                self.eager.arrived(part.indices, None)
            return self._record(sync, mean, None, 0)

        # Outer Nesterov step on the fragment's fp32 global parameters (its own momentum buffers). Never
        # with a non-finite value: without a finite mean the step is skipped.
        finite, left_out = self._judge(mean)
        update_norm = None
        if finite:
            with record_function("muloco::outer_step"):
                update_norm = part.outer_step(mean.values)
            if self.shard_group is not None:
                update_norm = math.sqrt(self.worker_sum(update_norm**2)[0])
        self.guard.record(left_out, f"sync of fragment {sync.fragment} at step {self.progress.steps}")
        for kind, count in mean.excluded.items():
            self.progress.excluded[kind] = self.progress.excluded.get(kind, 0) + count
        self.progress.fragment_syncs += 1
        self.progress.outer_steps = self.progress.fragment_syncs // len(self.fragments)
        if mean.bytes_sent or self.shard_group is not None:
            (sent,) = self.worker_sum(mean.bytes_sent)
            self.ledger.count(sent, mean.bytes_sent)

        if self.eager is not None:  # the mean is the next eager step's stale one; replicas follow theta_m
            self.eager.arrived(part.indices, mean.values if finite else None)
        if self.eager is None or self._settling:
            self._merge(part, replicas)
        record = self._record(sync, mean, update_norm, left_out)
        self.reducer.after_sync(self, mean, replicas)
        return record

    def _merge(self, part: Fragment, replicas: list) -> None:
        """local <- alpha local + (1 - alpha) global on the fragment (alpha = 0: restart from the global
        parameters)."""
        for replica in replicas:
            if part.whole and self.alpha == 0.0:
                replica.load_global(self.outer.params)
            else:
                replica.merge_global(self.outer.params, part.indices, self.alpha)
        if self.alpha > 0:
            part.unsynced = True  # the replicas keep part of their own drift
        if self.observer is not None:
            self.observer.restart_from(self.outer.params)

    def _judge(self, mean: Mean) -> tuple[bool, int]:
        """Whether the mean is finite, and how many replicas were left out. No mean at all (a swarm peer
        without a group, or behind it) is not divergence; a mean that overflowed from finite inputs is.
        Sharded: each rank holds its rows of the mean, decoded from its own sync group's messages; the
        worker steps only if every rank has finite rows, and counts what any rank left out."""
        finite = mean.values is not None and math.isfinite(global_norm(mean.values))
        overflowed = mean.values is not None and not finite
        left_out = mean.left_out
        if self.shard_group is not None:
            R = self.shard_group.world_size
            unusable, left, bad = self.worker_sum(float(not finite), float(mean.left_out), float(overflowed))
            finite, left_out, overflowed = unusable == 0, math.ceil(left / R), bad > 0
        return finite, max(left_out, 1) if overflowed else left_out

    def worker_sum(self, *values: float) -> list[float]:
        """Sums over the worker's ranks when sharded (one small all-reduce, a collective of the worker's
        ranks); the values otherwise."""
        if self.shard_group is None:
            return list(values)
        total = self.shard_group.all_reduce_sum([torch.tensor(values, dtype=torch.float64)]).wait()[0]
        return total.tolist()

    def _record(self, sync: InFlightSync, mean: Mean, update_norm: float | None, left_out: int) -> SyncRecord:
        applied = (self.progress.steps, self.progress.outer_steps, update_norm, left_out)
        return sync.record(mean, *applied, streaming=self.streaming)

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

    # -- the shared state a heal or a joiner takes (engine_state.py) ----------------------------------
    def export_state(self) -> tuple[list[torch.Tensor], dict[str, int]]:
        return export_shared_state(self)

    def adopt_state(self, tensors: list[torch.Tensor], meta: dict[str, int], replicas: list) -> None:
        adopt_shared_state(self, tensors, meta, replicas)

    def can_adopt(self) -> bool:
        return not self.in_flight and not self._is_last(self.progress.steps)

    # -- checkpoints (engine_state.py) ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return engine_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_engine_state(self, state)
