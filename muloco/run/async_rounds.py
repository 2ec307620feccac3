"""Asynchronous outer updates in a simulation (`sync.mode: async`; docs/heterogeneous.md): no round is a
barrier. Each worker trains its window from the global parameters it last pulled; when its window ends, its
pseudogradient (compressed, with its own error feedback) is applied at once by delayed Nesterov
(sync/delayed_nesterov.py, Liu et al. 2024, arXiv 2401.09135, Algorithm 3) and the worker pulls the new
global parameters and goes on.

One process hosts all K workers, so "when its window ends" is a virtual clock: a step of worker w takes
1 / v_w (train.speed), and the windows arrive in the order they end (ties: the lower worker first). The
order depends on the declared speeds only, so a run repeats bit for bit.

What we decided where the paper is silent:
- Equal tokens: the run ends when the workers together have trained K x total_steps steps; a window that
  would pass that budget is cut short, and a worker pulling after it is spent stays idle.
- The lr schedule runs on the virtual clock: a step taken at time t uses the schedule at step
  t x sum(v) / K, where a synchronous run at these speeds would be on average.
- A window's length is H, or with sync.pacing: by_speed DyLU's H_w by the declared speeds.
- bytes_sent_per_worker counts each arrival's message over K (the average worker's upload); the pull of
  the global parameters (fp32) is a download and is not counted.
- staleness (in each record): the arrivals applied between the worker's pull and its own arrival.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from muloco.compress import ErrorFeedback
from muloco.config import Config
from muloco.run.async_processes import AsyncProcesses, async_processes
from muloco.sync import SumCount, SyncRecord
from muloco.sync.arrivals import Arrivals, outer_book
from muloco.sync.counters import CommLedger, Component, Progress, wiring
from muloco.sync.gather import global_norm
from muloco.sync.guard import BadSyncGuard
from muloco.sync.messages import build_codecs


@dataclass
class AsyncRounds(Component):
    """The event loop's state: the virtual clock, every worker's window (its length, when it was pulled
    and when it ends), the steps handed out and arrived, the outer rule's and the error feedback's
    buffers (state_dict). A checkpoint falls between arrivals."""

    now: float = 0.0  # the virtual clock, in steps of a speed-1 worker
    window_steps: list[int] = field(default_factory=list)
    pulled_t: list[float] = field(default_factory=list)
    pulled_at: list[int] = field(default_factory=list)  # arrivals applied when the worker pulled
    ends_at: list[float] = field(default_factory=list)  # math.inf: idle
    compute_s: float = 0.0  # measured, over `computed` steps: the clock's seconds per step
    computed: int = 0
    replicas: list = wiring()
    book: Arrivals = wiring()  # the global parameters, the budget, the outer rule (sync/arrivals.py)
    speeds: list[float] = wiring()
    lr_multiplier: Callable[[int], float] = wiring()
    train_step: Callable[[Any, float], float] = wiring()  # (replica, lr) -> its loss
    progress: Progress = wiring()
    ledger: CommLedger = wiring()
    guard: BadSyncGuard = wiring()  # train.max_bad_syncs windows in a row left out stop the run
    total_steps: int = wiring(0)
    feedback: list = wiring()
    bases: list = field(default_factory=list)  # each worker's pulled global parameters (fp32)

    @property
    def workers(self) -> int:
        return len(self.replicas)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.book.params

    @property
    def arrivals(self) -> int:
        return self.book.arrivals

    @property
    def credited(self) -> int:
        return self.book.credited

    def arrive_next(self) -> SyncRecord | None:
        """The next window to end: trained, its pseudogradient applied, the worker's next window pulled.
        None when every window has arrived."""
        if not self.ends_at:  # the run's start: every worker pulls
            K = self.workers
            self.window_steps, self.pulled_t, self.pulled_at, self.ends_at = (
                [0] * K,
                [0.0] * K,
                [0] * K,
                [0.0] * K,
            )
            self.bases = [[p.detach().clone() for p in self.params] for _ in range(K)]
            for w in range(K):
                self._pull(w)
        w = min(range(self.workers), key=lambda i: (self.ends_at[i], i))
        if math.isinf(self.ends_at[w]):
            return None
        replica, steps = self.replicas[w], self.window_steps[w]
        replica.activate()
        losses = self._train(w)
        self.now = self.ends_at[w]
        delta = replica.pseudogradient(self.bases[w])
        replica.deactivate()
        norm = global_norm(delta)
        staleness = self.arrivals - self.pulled_at[w]
        finite = math.isfinite(norm) and math.isfinite(sum(losses))
        codec = self.book.codec
        message = (codec.encode(delta, self.feedback[w]) if codec is not None else delta) if finite else None
        update_norm, payload = self.book.apply(steps, message)
        if update_norm is not None:
            self.ledger.bytes_sent += payload / self.workers
            self.ledger.rank_bytes_sent += payload / self.workers
            self.ledger.peak_bytes_per_sync = max(self.ledger.peak_bytes_per_sync, payload)
            self.ledger.payload_by_fragment[0] = payload
        else:  # left out, as a synchronous run leaves a non-finite replica out (guard.py)
            replica.reset_to(self.bases[w])
            if self.feedback[w] is not None:
                self.feedback[w].reset()
        self.guard.record(
            0 if update_norm is not None else 1, f"worker {w}'s window at step {self.progress.steps}"
        )
        self._advance_progress()
        started = self._schedule_step(self.pulled_t[w])
        self._pull(w)
        if all(math.isinf(t) for t in self.ends_at):  # the run ends on one model, as DiLoCo does
            for r in self.replicas:
                r.load_global(self.params)
        fields = {
            "worker": w,
            "window_steps": steps,
            "staleness": staleness,
            "payload_bytes": payload,
            "update_norm": update_norm,
            "virtual_time_s": round(self.virtual_s, 3),
        }
        loss = SumCount(sum(losses), len(losses)) if update_norm is not None else SumCount()
        return SyncRecord(
            0, started, self.progress.steps, self.progress.outer_steps, fields, loss, SumCount(norm, 1)
        )

    def next_records(self) -> Iterator[SyncRecord]:
        """The next window to end, applied (none once every window has arrived)."""
        record = self.arrive_next()
        if record is not None:
            yield record

    def eval_params(self) -> list[torch.Tensor]:
        return self.params

    evaluates_mid_run = True

    @property
    def virtual_s(self) -> float:
        """The clock in seconds: its steps at the measured seconds per step."""
        return self.now * (self.compute_s / self.computed if self.computed else 0.0)

    def _train(self, w: int) -> list[float]:
        replica, v = self.replicas[w], self.speeds[w]
        losses = []
        t0 = time.perf_counter()
        for j in range(self.window_steps[w]):
            lr = self.lr_multiplier(self._schedule_step(self.pulled_t[w] + j / v))
            losses.append(self.train_step(replica, lr))
            replica.inner_steps += 1
        seconds = time.perf_counter() - t0
        self.compute_s += seconds  # this host runs every worker at full speed: a speed-1 step's time
        self.computed += self.window_steps[w]
        self.progress.worker_compute_s += seconds / self.workers
        return losses

    def _schedule_step(self, t: float) -> int:
        """The lr schedule's step at virtual time t: a synchronous run's average progress by then."""
        rate = sum(self.speeds) / self.workers
        return min(self.total_steps - 1, math.floor(t * rate + 1e-9))

    def _pull(self, w: int) -> None:
        """Worker w takes the global parameters and its next window (cut to the steps the budget has left)."""
        steps = self.book.claim(w)
        self.replicas[w].load_global(self.params)
        for base, p in zip(self.bases[w], self.params, strict=True):
            base.copy_(p)
        self.window_steps[w], self.pulled_t[w], self.pulled_at[w] = steps, self.now, self.arrivals
        self.ends_at[w] = self.now + steps / self.speeds[w] if steps else math.inf

    def _advance_progress(self) -> None:
        p = self.progress
        p.steps = self.credited // self.workers
        p.fragment_syncs = self.arrivals
        p.outer_steps = self.arrivals // self.workers

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["book"] = self.book.state_dict()
        state["feedback"] = [f.state_dict() if f is not None else None for f in self.feedback]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.book.load_state_dict(state.pop("book"))
        for f, saved in zip(self.feedback, state.pop("feedback"), strict=True):
            if f is not None:
                f.load_state_dict(saved)
        super().load_state_dict(state)


def async_rounds(cfg: Config, trainer: Any) -> AsyncRounds | AsyncProcesses | None:
    """sync.mode: async's event loop over the trainer's replicas and global parameters (None: sync)."""
    if cfg.sync.mode != "async":
        return None
    if trainer.backend.world_size > 1:
        return async_processes(cfg, trainer)  # one worker a process, the parameter owner on rank 0
    c, t = cfg.compression, cfg.train
    params = trainer.engine.global_params
    codecs = build_codecs(trainer.replicas[0].model, [list(range(len(params)))], c)
    with_ef = bool(codecs) and c.error_feedback
    shape = (trainer.micro_batches, trainer.seqs_per_micro)
    return AsyncRounds(
        replicas=trainer.replicas,
        book=outer_book(cfg, params, codecs[0] if codecs else None, trainer.pacing, trainer.total_steps),
        speeds=cfg.worker_speeds,
        lr_multiplier=trainer._lr_multiplier,
        train_step=lambda replica, lr: replica.train_step(*shape, lr, t.grad_clip, trainer.autocast),
        progress=trainer.progress,
        ledger=trainer.ledger,
        guard=trainer.engine.guard,
        total_steps=trainer.total_steps,
        feedback=[ErrorFeedback(c.ef_decay, c.ef_alpha) if with_ef else None for _ in trainer.replicas],
    )
