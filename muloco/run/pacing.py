"""Workers of different speeds (docs/heterogeneous.md): which inner steps each worker takes in a round
(sync.pacing), what its steps cost when its speed is emulated (train.speed), and the virtual clock of a
simulated run.

Pacing by speed is DyLU (Liu et al. 2024, arXiv 2401.09135, "dynamic local updates"): worker w takes
H_w = max(1, floor(v_w / v_max x H)) inner steps per round, so that every worker's round takes about as
long as the fastest one's; its steps are the first H_w of the round, at the round's lr schedule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from muloco.comm import Backend
from muloco.config import Config
from muloco.errors import UserError
from muloco.sync.counters import Component, wiring


def worker_pacing(cfg: Config, processes: int, local_workers: int) -> Pacing:
    """The run's pacing. Emulated speeds need each worker's time to be its own: a process hosting one
    worker (it sleeps) or one process hosting them all (a virtual clock), not several processes of
    several workers each."""
    speeds = cfg.worker_speeds
    if any(v != 1.0 for v in speeds) and processes > 1 and local_workers > 1:
        raise UserError(
            f"train.speed emulates each worker's speed with one worker per process or all in one process; "
            f"this run hosts {local_workers} workers in each of {processes} processes: launch {cfg.workers} "
            "processes or 1"
        )
    by_speed = cfg.sync.pacing == "by_speed"
    return Pacing(
        speeds=list(speeds),
        emulated_speeds=list(speeds),
        every=cfg.sync.every,
        by_speed=by_speed,
        measured=by_speed and cfg.sync.pacing_speeds == "measured",
        tolerance=cfg.sync.pacing_tolerance,
        weight_by_tokens=cfg.sync.weight_by_tokens,
    )


@dataclass
class Pacing(Component):
    """speeds: the relative speeds that size each worker's round (train.speed's, or measured: the previous
    round's step times, the fastest worker's 1); a checkpoint keeps them, so a resumed run paces alike."""

    added_later: ClassVar[bool] = True  # checkpoints written before it resume without it
    speeds: list[float]
    trained_steps: int = 0  # inner steps all workers took in the rounds done
    emulated_speeds: list[float] = wiring(None)  # train.speed: what emulation slows each worker to
    every: int = wiring(1)  # H
    by_speed: bool = wiring(False)
    measured: bool = wiring(False)
    tolerance: float = wiring(0.0)  # measured: speeds this close to the fastest's pace as the fastest
    weight_by_tokens: bool = wiring(False)
    # measured: the last round's step times, read at the next round's close (exchange)
    previous_times: list[list[float]] = field(default_factory=list, metadata={"optional": True})
    pending: Any = wiring(None)  # their all-reduce in flight (several processes)

    def __post_init__(self) -> None:
        if self.emulated_speeds is None:
            self.emulated_speeds = list(self.speeds)

    @property
    def emulated(self) -> bool:
        return any(v != 1.0 for v in self.emulated_speeds)

    def round_start(self, end: int) -> int:
        """The first step of the round that ends at step `end` (the run's last round may be shorter)."""
        return (end - 1) // self.every * self.every

    def steps_in_round(self, worker: int, length: int) -> int:
        """The inner steps worker `worker` takes in a round of `length` steps."""
        if not self.by_speed:
            return length
        # + 1e-9: a measured ratio that is whole in exact arithmetic (0.5 x 4) stays whole
        return max(1, math.floor(self.speeds[worker] / max(self.speeds) * length + 1e-9))

    def stop_at(self, worker: int, end: int) -> int:
        """The step at which worker `worker` stops training in the round that ends at `end`."""
        start = self.round_start(end)
        return start + self.steps_in_round(worker, end - start)

    def weight(self, worker: int, end: int) -> float:
        """sync.weight_by_tokens: the worker's share of the round's tokens, x K (the plain mean: 1)."""
        if not self.weight_by_tokens:
            return 1.0
        length = end - self.round_start(end)
        steps = [self.steps_in_round(w, length) for w in range(len(self.speeds))]
        return len(steps) * steps[worker] / sum(steps)

    def observe(self, step_times: list[tuple[float, int]]) -> None:
        """measured: the round's (seconds, inner steps) of every worker size the next rounds, each worker's
        speed the fastest one's step time over its own (within `tolerance` of 1: 1, timing noise); a worker
        that took no step keeps its speed."""
        if not self.measured:
            return
        times = [seconds / steps if steps else None for seconds, steps in step_times]
        known = [t for t in times if t]
        if not known:
            return
        fastest = min(known)
        speeds = [fastest / t if t else v for t, v in zip(times, self.speeds, strict=True)]
        self.speeds = [1.0 if v >= 1.0 - self.tolerance else v for v in speeds]

    def exchange(
        self, backend: Backend, step_times: tuple[tuple[float, int], ...]
    ) -> list[tuple[float, int]]:
        """measured: every worker's (seconds, inner steps) of the round before this one, from every process,
        and this round's all-reduce started in the background (read at the next round's close). One round
        stale, because an all-reduce that waited here put a collective's round trips, and the fast hosts'
        wait for the slowest, before every sync (docs/records/wan.md, hosts of different speeds). Not
        measured: []."""
        if not self.measured:
            return []
        self._settle()
        ready = [(seconds, round(steps)) for seconds, steps in self.previous_times]
        if backend.world_size == 1:
            self.previous_times = [list(t) for t in step_times]
        else:
            local = torch.tensor(step_times, dtype=torch.float64)  # zeros for the other processes' workers
            self.previous_times, self.pending = [], backend.all_reduce_sum([local])
        return ready

    def _settle(self) -> None:
        if self.pending is not None:
            self.previous_times, self.pending = self.pending.wait()[0].tolist(), None

    def state_dict(self) -> dict[str, Any]:
        self._settle()  # the round's step times, all-reduced: a resumed run paces as this one would
        return super().state_dict()

    def close_round(self, end: int, step_times: list[tuple[float, int]]) -> None:
        """The round that ended at step `end` is done: its steps counted and, measured, the workers' step
        times in it (seconds, inner steps) size the next rounds."""
        length = end - self.round_start(end)
        self.trained_steps += sum(self.steps_in_round(w, length) for w in range(len(self.speeds)))
        self.observe(step_times)

    def worker_steps_until(self, step: int, total_steps: int) -> int:
        """Inner steps all workers together took up to global step `step` (whole rounds, as the log sees
        them at its sync and eval records). Measured speeds: the rounds done so far (`step` is the
        run's current step)."""
        if not self.by_speed:
            return step * len(self.speeds)
        if self.measured:
            return self.trained_steps
        done, start = 0, 0
        while start < step:
            length = min(self.every, total_steps - start, step - start)
            done += sum(self.steps_in_round(w, length) for w in range(len(self.speeds)))
            start += self.every
        return done

    def emulate(self, worker: int, seconds: float) -> float:
        """An inner step that took `seconds` on this worker's hardware, at its emulated speed: the extra
        time it sleeps (a process hosting one worker), returned with the step's emulated seconds."""
        extra = seconds * (1.0 / self.emulated_speeds[worker] - 1.0)
        if extra > 0:
            time.sleep(extra)
        return seconds + extra


@dataclass
class SpeedClock(Component):
    """A simulated run's virtual clock (several workers hosted by one process, one after another or batched):
    each round advances by its slowest worker's emulated compute, steps x t / v_w with t the round's mean
    measured step time, so a slower worker costs the run what it would on its own host without a sleep."""

    added_later: ClassVar[bool] = True  # checkpoints written before it resume without it
    virtual_s: float = 0.0
    rounds: int = 0
    simulated: bool = field(default=False, metadata={"state": False})  # whether it runs (and is reported)

    def advance(self, speeds: list[float], steps: list[int], compute_s: float) -> list[float]:
        """One round of the local workers (speeds, steps they took) that took `compute_s` of measured time
        in all: their emulated seconds; the clock advances by the longest."""
        taken = sum(steps)
        per_step = compute_s / taken if taken else 0.0
        emulated = [n * per_step / v for n, v in zip(steps, speeds, strict=True)]
        self.virtual_s += max(emulated, default=0.0)
        self.rounds += 1
        return emulated

    def summary(self) -> dict[str, Any]:
        return {"virtual_time_s": round(self.virtual_s, 3)} if self.simulated else {}


def round_step_times(replicas: list, workers: int, is_lead: bool) -> tuple[tuple[float, int], ...]:
    """(seconds, inner steps) of each of the K workers this round: this process's replicas', zeros for the
    others' (the log's means over the processes fill them in). A worker of R ranks is counted once."""
    times = [(0.0, 0)] * workers
    if is_lead:
        for replica in replicas:
            times[replica.index] = (replica.round_s, replica.round_steps)
    return tuple(times)
