"""Asynchronous outer updates over processes (`sync.mode: async`, backend.kind=torch; docs/heterogeneous.md):
one worker per process trains its window from the global parameters it last pulled, hands the window's
pseudogradient to the parameter owner on rank 0 (sync/param_owner.py), which applies it at once by delayed
Nesterov, and goes on from the parameters the owner answers with. No round is a barrier: a slower worker
hands in fewer windows, and no one waits for it.

What we decided where the paper (Liu et al. 2024, arXiv 2401.09135) is silent, as in the simulation
(async_rounds.py): equal tokens (the owner cuts the windows to the run's budget of K x total_steps worker
steps), windows of H or DyLU's H_w by the declared speeds. Different from the simulation, which has a
virtual clock: a window's lr schedule starts at the step the workers have trained on average when it is
handed out (the owner's arrived steps / K), and the order of arrivals is the machines' (a run does not
repeat bit for bit). Checkpoints: at the end and on a signal, when every window has arrived (the owner
answers 0 steps to every worker after a signal), so a resumed run starts with every worker pulling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from muloco.comm.point_to_point import PointToPoint
from muloco.compress import ErrorFeedback
from muloco.config import Config
from muloco.errors import UserError
from muloco.sync import SumCount, SyncRecord
from muloco.sync.arrivals import fp32_message, outer_book
from muloco.sync.counters import Component, wiring
from muloco.sync.gather import global_norm
from muloco.sync.messages import build_codecs
from muloco.sync.param_owner import (
    LEFT_OUT,
    PULL,
    WINDOW,
    Answer,
    Arrived,
    ParameterOwner,
    WindowIn,
    exchange_with_owner,
)


@dataclass
class AsyncProcesses(Component):
    """This process's worker (state: its error feedback; rank 0 also the owner's book)."""

    replica: Any = wiring()
    base: list[torch.Tensor] = wiring()  # the global parameters it last pulled (its own copy)
    global_params: list[torch.Tensor] = wiring()  # the engine's (rank 0: the owner's)
    owner: ParameterOwner | None = wiring()  # rank 0
    channel: PointToPoint | None = wiring()  # rank > 0
    backend: Any = wiring()
    codec: Any = wiring()
    feedback: ErrorFeedback | None = wiring()
    lr_multiplier: Callable[[int], float] = wiring()
    train_step: Callable[[Any, float], float] = wiring()
    emulate: Callable[[int, float], float] = wiring()  # train.speed's sleep (pacing.py)
    progress: Any = wiring()
    ledger: Any = wiring()
    guard: Any = wiring()
    stopping: Callable[[], bool] = wiring()  # a signal reached this process
    workers: int = wiring(0)
    answer: Answer | None = wiring()  # the window being trained (None: not pulled yet)
    finished: bool = wiring(False)
    credited: int = wiring(0)
    virtual_s: float = wiring(0.0)  # no virtual clock over processes

    def next_records(self) -> Iterator[SyncRecord]:
        """Train this worker's window, hand it in, take the next; rank 0: the windows that arrived, each
        yielded as its counts are booked (so its log record is timed at them)."""
        if self.answer is None:
            self._take(self._exchange(WindowIn(PULL)))
        else:
            window = self._train_window()
            self._take(self._exchange(window))
            if window.kind == LEFT_OUT:  # the non-finite guard (guard.py): a fresh start from the pull
                self.replica.reset_to(self.base)
                if self.feedback is not None:
                    self.feedback.reset()
        if self.owner is not None:
            if self.answer.steps == 0:
                self.owner.join()  # every other worker done
            for arrived in self.owner.drain():
                yield self._record(arrived)
        if self.answer.steps == 0:
            self._finish()

    def _train_window(self) -> WindowIn:
        replica, start = self.replica, self.answer.start_step
        losses, started = [], time.perf_counter()
        for j in range(self.answer.steps):
            t0 = time.perf_counter()
            losses.append(self.train_step(replica, self.lr_multiplier(start + j)))
            self.emulate(replica.index, time.perf_counter() - t0)
            replica.inner_steps += 1
        seconds = time.perf_counter() - started
        replica.compute_time_s += seconds
        self.progress.worker_compute_s += seconds
        delta = replica.pseudogradient(self.base)
        norm, loss_sum = global_norm(delta), sum(losses)
        window = WindowIn(LEFT_OUT, len(losses), loss_sum, len(losses), norm, self.stopping())
        if math.isfinite(norm) and math.isfinite(loss_sum):
            window.kind = WINDOW
            window.message = self.codec.encode(delta, self.feedback) if self.codec else fp32_message(delta)
        return window

    def _exchange(self, window: WindowIn) -> Answer:
        if self.owner is not None:
            self.owner.start()
            return self.owner.exchange(0, window)
        started = time.perf_counter()
        answer = exchange_with_owner(self.channel, window)
        self.ledger.comm_wait_s += time.perf_counter() - started  # the round trip to the owner
        return answer

    def _take(self, answer: Answer) -> None:
        """Train the next window from the owner's parameters."""
        self.answer, self.credited = answer, answer.credited
        flat = torch.frombuffer(bytearray(answer.params), dtype=torch.float32)
        for b, part in zip(self.base, flat.split([b.numel() for b in self.base]), strict=True):
            b.copy_(part.view_as(b))
        self.replica.load_global(self.base)
        self._count(answer.arrivals, answer.credited)

    def _count(self, arrivals: int, credited: int) -> None:
        p = self.progress
        self.credited = credited
        p.steps, p.fragment_syncs, p.outer_steps = (
            credited // self.workers,
            arrivals,
            arrivals // self.workers,
        )

    def _record(self, arrived: Arrived) -> SyncRecord:
        """Rank 0's log of one arrival: booked (bytes over K, the simulation's rule) and guarded."""
        window = arrived.window
        if arrived.update_norm is not None:
            self.ledger.bytes_sent += arrived.payload_bytes / self.workers
            self.ledger.rank_bytes_sent += arrived.payload_bytes / self.workers
            self.ledger.peak_bytes_per_sync = max(self.ledger.peak_bytes_per_sync, arrived.payload_bytes)
            self.ledger.payload_by_fragment[0] = arrived.payload_bytes
        self._count(arrived.arrivals, arrived.credited)
        step = self.progress.steps
        self.guard.record(0 if arrived.update_norm is not None else 1, f"worker {arrived.worker}'s window")
        fields = {
            "worker": arrived.worker,
            "window_steps": window.steps,
            "staleness": arrived.staleness,
            "payload_bytes": arrived.payload_bytes,
            "update_norm": arrived.update_norm,
        }
        loss = SumCount(window.loss_sum, window.loss_count) if arrived.update_norm is not None else SumCount()
        return SyncRecord(
            0, arrived.started_step, step, self.progress.outer_steps, fields, loss, SumCount(window.norm, 1)
        )

    def _finish(self) -> None:
        """This worker is done (rank 0: every worker). Every rank takes the final global parameters and
        counts from rank 0 (a collective: each rank's last act), so the run ends on one model and every
        rank's checkpoint is at the same step."""
        counts = torch.tensor([self.progress.fragment_syncs, self.credited], dtype=torch.float64)
        self.backend.broadcast([counts, *self.global_params]).wait()
        self._count(int(counts[0]), int(counts[1]))
        torch._foreach_copy_(self.base, self.global_params)
        self.replica.load_global(self.global_params)
        self.finished = True

    def eval_params(self) -> list[torch.Tensor]:
        """The global parameters to evaluate: rank 0's, copied (its owner's thread updates them)."""
        return self.owner.snapshot() if self.owner is not None and not self.finished else self.base

    @property
    def evaluates_mid_run(self) -> bool:
        return self.owner is not None

    def state_dict(self) -> dict[str, Any]:
        return {
            "feedback": self.feedback.state_dict() if self.feedback is not None else None,
            "book": self.owner.book.state_dict() if self.owner is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
        if self.owner is not None:
            self.owner.book.load_state_dict(state["book"])
        self.answer = None  # every worker pulls first


def async_processes(cfg: Config, trainer: Any) -> AsyncProcesses:
    """The worker of this process, and on rank 0 the parameter owner."""
    backend, K = trainer.backend, cfg.workers
    if backend.world_size != K or len(trainer.replicas) != 1:
        raise UserError(
            f"sync.mode=async over backend.kind=torch runs one worker per process: workers={K} with "
            f"{backend.world_size} processes; start as many processes as workers (muloco launch --nproc {K})"
        )
    replica, params, c = trainer.replicas[0], trainer.engine.global_params, cfg.compression
    codecs = build_codecs(replica.model, [list(range(len(params)))], c)
    codec = codecs[0] if codecs else None
    channel = PointToPoint(cfg.backend.torch.timeout_s)  # a collective: every rank, here
    owner = (
        ParameterOwner(outer_book(cfg, params, codec, trainer.pacing, trainer.total_steps), channel)
        if backend.rank == 0
        else None
    )
    t = cfg.train
    shape = (trainer.micro_batches, trainer.seqs_per_micro)
    return AsyncProcesses(
        replica=replica,
        base=[p.detach().clone() for p in params],
        global_params=params,
        owner=owner,
        channel=channel if owner is None else None,
        backend=backend,
        codec=codec,
        feedback=ErrorFeedback(c.ef_decay, c.ef_alpha) if codec is not None and c.error_feedback else None,
        lr_multiplier=trainer._lr_multiplier,
        train_step=lambda r, lr: r.train_step(*shape, lr, t.grad_clip, trainer.autocast),
        emulate=trainer.pacing.emulate,
        progress=trainer.progress,
        ledger=trainer.ledger,
        guard=trainer.engine.guard,
        stopping=lambda: trainer.stop.signal is not None,
        workers=K,
    )
