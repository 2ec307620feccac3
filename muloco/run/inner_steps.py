"""Phase 1 of a DiLoCo round: each of this process's replicas takes its inner steps up to the next sync
event, on its own data stream, one replica after another or all together (simulation.batched)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from muloco.run.batched import step_together
from muloco.run.offload import ReplicaOffload
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
    ) -> None:
        """shape: (micro-batches per step, sequences per micro-batch, grad_clip)."""
        self.replicas, self.progress, self.stop = replicas, progress, stop
        self.lr_multiplier, self.autocast, self.offload = lr_multiplier, autocast, offload
        self.micro_batches, self.seqs_per_micro, self.grad_clip = shape
        self.batched = batched

    def run_until(self, end: int) -> None:
        """Every replica to inner step `end`, or until a stop is requested (a single-process run stops
        after the current inner step: each replica's own step counter, checkpointed, lets the resumed run
        finish the segment where it left off). Round losses go to progress.round_losses."""
        if self.batched:
            self._together(end)
            return
        segment_times = []
        for i, replica in enumerate(self.replicas):
            replica.activate()
            if i + 1 < len(self.replicas):  # offload: the next replica arrives while this one trains
                self.replicas[i + 1].prefetch()
            t0 = time.perf_counter()
            while replica.inner_steps < end and not self.stop.now():
                lr = self.lr_multiplier(replica.inner_steps)
                loss = replica.train_step(
                    self.micro_batches, self.seqs_per_micro, lr, self.grad_clip, self.autocast
                )
                self._count(replica, loss)
            segment_times.append(time.perf_counter() - t0)
            replica.compute_time_s += segment_times[-1]
            replica.deactivate()
        if self.offload is not None:
            self.offload.settle()
        self.progress.worker_compute_s += sum(segment_times) / len(segment_times)

    def _together(self, end: int) -> None:
        """simulation.batched: every replica computes its gradients for step s, then one optimizer step
        updates them all (batched.py). Replicas left apart by an interrupted segment step separately until
        they meet again."""
        t0 = time.perf_counter()
        while not self.stop.now():
            behind = [replica for replica in self.replicas if replica.inner_steps < end]
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
        if math.isfinite(loss):
            self.progress.round_losses.append(loss)
        elif replica.healthy:
            replica.healthy = False
            log.warning("replica=%d step=%d: non-finite loss %s", replica.index, replica.inner_steps, loss)
