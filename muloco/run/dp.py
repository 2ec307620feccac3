"""`method: dp`, the data-parallel baseline: one model whose gradients are averaged over the K workers'
batches every step, so the maths is K-worker data parallelism (docs/design.md). A process hosts the streams of
its replicas; the gradient all-reduce across processes is an identity in one process."""

from __future__ import annotations

import math
import time

import torch
from torch.profiler import record_function

from muloco.comm import Backend, ring_allreduce_bytes
from muloco.net.wan import allreduce_seconds
from muloco.run.ddp_hooks import CommHookDDP
from muloco.run.replica import Replica, forward_backward, set_lr_multiplier
from muloco.sync.counters import CommLedger, Progress, WanProjection
from muloco.sync.gather import global_norm
from muloco.sync.guard import BadSyncGuard


class DataParallel:
    def __init__(
        self,
        replica: Replica,
        streams: list,
        backend: Backend,
        *,
        workers: int,
        micro_batches: int,
        seqs_per_micro: int,
        grad_clip: float,
        max_bad_syncs: int,
        progress: Progress,
        ledger: CommLedger,
        wan: WanProjection,
        ddp: CommHookDDP | None = None,
    ) -> None:
        """streams: the K workers' data streams this process computes; a non-finite step is skipped and
        max_bad_syncs of them in a row stop the run (the same guard as DiLoCo's syncs)."""
        self.replica, self.streams, self.backend, self.workers = replica, streams, backend, workers
        self.micro_batches, self.seqs_per_micro, self.grad_clip = micro_batches, seqs_per_micro, grad_clip
        self.guard = BadSyncGuard(progress, workers, max_bad_syncs)
        self.progress, self.ledger, self.wan = progress, ledger, wan
        self.grad_bytes = 4 * sum(p.numel() for p in replica.model.parameters())  # fp32 gradients
        self.bucket_bytes: list[int] = []  # the last step's all-reduces (summary.json's dp_bucket_bytes)
        self.ddp = ddp  # torch's DDP averages (dp.comm_hook: and compresses) during the backward

    def step(self, lr_multiplier: float, autocast) -> tuple[float, int]:
        """One step: gradients averaged over the K workers' batches, one optimizer step. Returns this
        process's (sum of micro-batch losses, their count)."""
        K, replica = self.workers, self.replica
        set_lr_multiplier(replica.optimizer, lr_multiplier)
        loss_sum = 0.0
        t0 = time.perf_counter()
        with record_function("muloco::forward_backward"):
            for stream in self.streams:
                batches = (stream.next_batch(self.seqs_per_micro) for _ in range(self.micro_batches))
                if self.ddp is not None:  # one stream: one worker per process
                    args = (self.micro_batches, replica.device, autocast)
                    loss_sum += self.ddp.forward_backward(batches, *args)
                    continue
                scale = 1.0 / (K * self.micro_batches)
                loss_sum += forward_backward(replica.model, batches, scale, replica.device, autocast)
        # One worker computes one of the K batches: its share of this process's forward/backward time.
        # Under DDP the all-reduces overlap the backward, which waits for the last of them at its end: that
        # wait is time on the network, not compute.
        elapsed = time.perf_counter() - t0
        if self.ddp is not None:
            wait = self.ddp.take_wait_s()
            self.ledger.comm_wait_s += wait
            elapsed -= wait
        self.progress.worker_compute_s += elapsed / len(self.streams)

        grads = [p.grad for p in replica.model.parameters()]
        if self.ddp is None:  # gradient all-reduce across processes: every process calls it each step
            t0 = time.perf_counter()
            self.backend.all_reduce_sum(grads).wait()
            self.ledger.comm_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        # Every process holds the same summed gradients, so all skip a non-finite step alike. Clipping
        # measures the norm anyway: one pass over the gradients, not two.
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(replica.model.parameters(), self.grad_clip).item()
        else:
            norm = global_norm(grads)
        finite = math.isfinite(norm)
        if finite:
            replica.optimizer.step()
        replica.optimizer.zero_grad(set_to_none=True)
        step = self.progress.steps + 1
        self.guard.record(0 if finite else K, f"dp step {step} (non-finite gradients: skipped)")
        self.progress.worker_compute_s += time.perf_counter() - t0
        self.progress.steps = step
        payloads = self.ddp.take_payloads() if self.ddp is not None else [self.grad_bytes]
        self.bucket_bytes = payloads
        self.ledger.count(sum(ring_allreduce_bytes(payload, K) for payload in payloads))
        if self.wan.link is not None:
            self.wan.project(sum(allreduce_seconds(self.wan.link, payload, K) for payload in payloads), 0)
        return loss_sum, len(self.streams) * self.micro_batches

    @property
    def gradient_sync(self) -> str:
        """summary.json's dp_gradients: torch_ddp (buckets all-reduced during the backward) or all_reduce
        (one flat all-reduce after it: the simulation's, the reference)."""
        return "torch_ddp" if self.ddp is not None else "all_reduce"

    def state_dict(self) -> dict:
        hook = {"comm_hook": self.ddp.state_dict()} if self.ddp is not None else {}
        return {"streams": [s.state_dict() for s in self.streams], **hook}

    def load_state_dict(self, state: dict) -> None:
        for stream, stream_state in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(stream_state)
        if self.ddp is not None:  # a checkpoint of the flat all-reduce has no hook state
            self.ddp.load_state_dict(state.get("comm_hook", {}))
