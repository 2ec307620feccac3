"""Phase 1 of a DiLoCo round: each of this process's replicas takes its inner steps up to the next sync
event, on its own data stream, one replica after another or all together (simulation.batched)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from muloco.run.batched import step_together
from muloco.run.offload import ReplicaOffload
from muloco.run.pacing import Pacing, SpeedClock
from muloco.run.replica import Replica
from muloco.run.signals import StopRequest
from muloco.sync.counters import Progress

log = logging.getLogger("muloco")


class InnerSteps:
    def __init__(
        self,
        replicas: list[Replica],
        progress: Progress,
        stop: StopRequest,
        lr_multiplier: Callable[[int], float],
        shape: tuple[int, int, float],
        autocast: Callable,
        offload: ReplicaOffload | None,
        *,
        batched: bool,
        pacing: Pacing | None = None,
        clock: SpeedClock | None = None,
    ) -> None:
        """shape: (micro-batches per step, sequences per micro-batch, grad_clip). pacing: each worker's
        steps per round and emulated speed (pacing.py); clock: a simulation's virtual clock (the workers'
        speeds are then emulated on it, without sleeping)."""
        self.replicas, self.progress, self.stop = replicas, progress, stop
        self.lr_multiplier, self.autocast, self.offload = lr_multiplier, autocast, offload
        self.micro_batches, self.seqs_per_micro, self.grad_clip = shape
        self.batched = batched
        self.pacing = pacing or Pacing(speeds=[1.0] * (max(r.index for r in replicas) + 1))
        self.clock = clock
        self.sleeps = clock is None and self.pacing.emulated  # a process hosting one worker

    def run_until(self, end: int) -> None:
        """Every replica to inner step `end` (pacing by speed: to its share of the round, then counted as
        done), or until a stop is requested (a single-process run stops after the current inner step: each
        replica's own step counter, checkpointed, lets the resumed run finish the segment where it left
        off). Round losses go to progress.round_losses; each replica's round_steps and round_s say what
        this round cost it."""
        for replica in self.replicas:
            replica.round_steps, replica.round_s = 0, 0.0
        t0 = time.perf_counter()
        if self.batched:
            self._together(end)
        else:
            self._one_by_one(end)
        for replica in self.replicas:
            if replica.inner_steps == self.pacing.stop_at(replica.index, end):
                replica.inner_steps = end  # its share of the round is done
        if self.clock is not None:
            speeds = [self.pacing.emulated_speeds[r.index] for r in self.replicas]  # not the pacing's
            steps = [r.round_steps for r in self.replicas]
            emulated = self.clock.advance(speeds, steps, time.perf_counter() - t0)
            for replica, seconds in zip(self.replicas, emulated, strict=True):
                replica.round_s = seconds

    def _one_by_one(self, end: int) -> None:
        segment_times = []
        for i, replica in enumerate(self.replicas):
            replica.activate()
            if i + 1 < len(self.replicas):  # offload: the next replica arrives while this one trains
                self.replicas[i + 1].prefetch()
            t0 = time.perf_counter()
            stop_at = self.pacing.stop_at(replica.index, end)
            while replica.inner_steps < stop_at and not self.stop.now():
                lr = self.lr_multiplier(replica.inner_steps)
                t_step = time.perf_counter()
                loss = replica.train_step(
                    self.micro_batches, self.seqs_per_micro, lr, self.grad_clip, self.autocast
                )
                seconds = time.perf_counter() - t_step
                replica.round_s += self.pacing.emulate(replica.index, seconds) if self.sleeps else seconds
                self._count(replica, loss)
            segment_times.append(time.perf_counter() - t0)
            replica.compute_time_s += segment_times[-1]
            replica.deactivate()
        if self.offload is not None:
            self.offload.settle()
        self.progress.worker_compute_s += sum(segment_times) / len(segment_times)

    def _together(self, end: int) -> None:
        """simulation.batched: every replica computes its gradients for step s, then one optimizer step
        updates them all (batched.py). Replicas left apart by an interrupted segment (or, pacing by speed,
        done with their share) step separately until they meet again."""
        t0 = time.perf_counter()
        while not self.stop.now():
            behind = [r for r in self.replicas if r.inner_steps < self.pacing.stop_at(r.index, end)]
            if not behind:
                break
            step = min(replica.inner_steps for replica in behind)
            together = [replica for replica in behind if replica.inner_steps == step]
            lr = self.lr_multiplier(step)
            losses = [
                replica.compute_gradients(
                    self.micro_batches, self.seqs_per_micro, lr, self.grad_clip, self.autocast
                )
                for replica in together
            ]
            step_together([replica.optimizer for replica in together])
            for replica, loss in zip(together, losses, strict=True):
                self._count(replica, loss)
        share = (time.perf_counter() - t0) / len(self.replicas)  # a replica's share of the wall time
        for replica in self.replicas:
            replica.compute_time_s += share
        self.progress.worker_compute_s += share

    def _count(self, replica: Replica, loss: float) -> None:
        replica.inner_steps += 1
        replica.round_steps += 1
        if math.isfinite(loss):
            self.progress.round_losses.append(loss)
        elif replica.healthy:
            replica.healthy = False
            log.warning("replica=%d step=%d: non-finite loss %s", replica.index, replica.inner_steps, loss)
