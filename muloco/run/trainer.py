"""The training loop. One round reads top to bottom in `Trainer.run_round`:

    inner steps -> engine.round (apply the syncs due, start the ones scheduled: muloco/sync/engine.py)
    -> log the applied syncs; the loop then evaluates and checkpoints

A process hosts k >= 1 replicas of the run's K (docs/design.md). The sync protocol is the engine's
(muloco/sync/); which processes or peers it averages with is its reducer's (collectives over the local /
torch backend, a torchft quorum or a hivemind swarm). `method: dp` is the data-parallel baseline (dp.py).
The run's counters are components (sync/counters.py) that checkpoint themselves. Reliability (interrupts,
non-finite guards, checkpoints): docs/reliability.md.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from torch.profiler import record_function

from muloco.allocator import keep_freed_memory
from muloco.comm import Backend, build_backend
from muloco.comm.local import LocalBackend
from muloco.comm.topology import build_topology
from muloco.config import Config
from muloco.data import ReplicaStream, load_data, val_batches
from muloco.run.async_rounds import async_rounds
from muloco.run.batched import use_batched
from muloco.run.build import (
    alignment_probe,
    autocast_factory,
    check_comm_hook_world,
    initial_model,
    resolve_device,
    run_counters,
    training_method,
)
from muloco.run.checkpointing import RunCheckpoints
from muloco.run.evaluate import evaluate_global
from muloco.run.inner_steps import InnerSteps
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.metrics import MetricsLogger, finish_wandb, log_run_start, run_start_fields, start_wandb
from muloco.run.offload import ReplicaOffload, offload_applies
from muloco.run.pacing import SpeedClock, round_step_times, worker_pacing
from muloco.run.resume import check_same_config
from muloco.run.run_dir import (
    prepare_run_dir,
    run_dir_of,
    write_json_atomic,
    write_resolved_config,
    write_tokenizer_record,
)
from muloco.run.run_log import RunLog
from muloco.run.signals import EXIT_INTERRUPTED, StopRequest
from muloco.run.state import RngState, StateList
from muloco.run.summary import build_summary
from muloco.run.threads import set_threads
from muloco.sync import Reducer, SumCount, build_reducer

log = logging.getLogger("muloco")

__all__ = ["EXIT_INTERRUPTED", "Trainer", "train"]


class Trainer:
    def __init__(self, cfg: Config, backend: Backend | None = None) -> None:
        keep_freed_memory()  # each sync's large buffers reused, not faulted anew (muloco/allocator.py)
        self.cfg = cfg
        self.backend = backend or build_backend(cfg)
        self.reducer: Reducer | None = None
        try:
            self._set_up(cfg)
        except BaseException:
            # A set-up error ends the process: tear the connections down first (gloo aborts the process,
            # "terminate called", when its threads are still up at exit).
            self.backend.close()
            if self.reducer is not None:
                self.reducer.close()
            raise

    def _set_up(self, cfg: Config) -> None:
        K = cfg.workers
        self.is_main = self.backend.rank == 0
        self.device = resolve_device(cfg.device)
        set_threads(cfg.train.threads, self.device)
        self.run_dir = run_dir_of(cfg)  # created once the config and the data are known to be good
        check_same_config(self.backend, cfg.fingerprint())
        check_comm_hook_world(cfg, self.backend)

        # Workers of R ranks each (comm/topology.py); the reducer says which replicas this process hosts.
        self.topology = build_topology(self.backend, cfg.ranks_per_worker, sharded=cfg.sharding == "fsdp")
        self.reducer = build_reducer(cfg, self.topology)
        self.local_indices = self.reducer.local_replicas(K)
        self.checkpoints = RunCheckpoints(cfg, self.run_dir, self.backend, self.topology, self.local_indices)

        seq_len = cfg.model.seq_len
        self.data = load_data(cfg.data, seq_len)
        self.total_steps = cfg.total_steps
        self.seqs_per_micro = (cfg.train.micro_batch_tokens or cfg.worker_batch_tokens) // seq_len
        self.micro_batches = cfg.worker_batch_tokens // (self.seqs_per_micro * seq_len)
        self.val_set = val_batches(self.data.val, seq_len, cfg.train.eval_tokens, self.seqs_per_micro)
        prepare_run_dir(cfg, self.backend)

        template, self.init_source = initial_model(cfg, self.data.vocab_size, self.backend)  # identical
        self.num_params = sum(p.numel() for p in template.parameters())
        self.offload = ReplicaOffload(self.device) if offload_applies(cfg, self.device) else None
        local, offloaded = len(self.local_indices), self.offload is not None
        batched = use_batched(cfg.simulation.batched, self.device, local, cfg.ranks_per_worker, offloaded)
        self.batched = cfg.method == "diloco" and batched
        streams = [ReplicaStream(self.data.train, seq_len, r, K, cfg.run.seed) for r in self.local_indices]

        # The run's state, as components that checkpoint themselves (sync/counters.py, state.py).
        counters = run_counters(cfg, self.num_params)
        self.progress, self.ledger = counters["progress"], counters["ledger"]
        where = (self.backend, self.topology, self.reducer, self.local_indices, self.device, self.offload)
        shape = (self.micro_batches, self.seqs_per_micro)
        self.replicas, self.engine, self.dp = training_method(cfg, template, streams, where, shape, counters)
        probing = cfg.diagnostics.alignment
        self.probe = alignment_probe(cfg, template, self.data.train, self.device) if probing else None
        self.autocast = autocast_factory(cfg.train.precision, self.device)
        self.stop = StopRequest(self.backend)
        # Workers of different speeds (pacing.py): each one's steps per round, its emulated speed, and a
        # simulation's virtual clock (one process hosting several workers).
        self.pacing = worker_pacing(cfg, self.backend.world_size, len(self.local_indices))
        self.clock = SpeedClock(simulated=self.backend.world_size == 1 and len(self.local_indices) > 1)
        if self.engine is not None and cfg.sync.weight_by_tokens:
            self.engine.contribution_weight = self.pacing.weight
        shape = (self.micro_batches, self.seqs_per_micro, cfg.train.grad_clip)
        inner_args = (self.progress, self.stop, self._lr_multiplier, shape, self.autocast, self.offload)
        clock = self.clock if self.clock.simulated else None
        self.inner = InnerSteps(
            self.replicas, *inner_args, batched=self.batched, pacing=self.pacing, clock=clock
        )
        self.async_rounds = async_rounds(cfg, self)  # sync.mode: async: no barrier (None: sync)
        self.components = {
            **counters,
            "clock": self.clock,
            "pacing": self.pacing,
            "replicas": StateList(self.replicas),
            "rng": RngState(self.device),
            **({"engine": self.engine} if self.engine is not None else {"dp": self.dp}),
            **({"membership": m} if (m := getattr(self.reducer, "membership", None)) is not None else {}),
            **({"async": self.async_rounds} if self.async_rounds is not None else {}),
        }
        # Every component from the checkpoint `checkpoint.resume` names, if any (checkpointing.py).
        self.resumed_from = self.checkpoints.resume(self.components, self.replicas[0].model, self.init_source)
        if self.resumed_from is not None:
            p = self.progress
            log.info(
                "resumed checkpoint=%s step=%d outer_steps=%d", self.resumed_from, p.steps, p.outer_steps
            )
        if self.engine is not None:
            if self.probe is not None:
                self.engine.observer = self.probe
                self.probe.restart_from(self.engine.global_params, self.replicas[0].stream.position)
            self.engine.join(self.replicas, resumed=self.resumed_from is not None)
        if self.is_main:
            write_resolved_config(cfg, self.run_dir)
            write_tokenizer_record(self.run_dir, self.data)

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoints.directory

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, progress = self.cfg, self.progress
        wandb_run = start_wandb(cfg, self.run_dir) if cfg.logging.wandb and self.is_main else None
        resume_step = progress.steps if self.resumed_from else None
        where = (self.run_dir / "metrics.jsonl", self.total_steps, cfg.logging.progress, wandb_run)
        metrics = MetricsLogger(*where, resume_step, self.is_main)
        timing = (self.tokens_at, self.total_steps, progress.elapsed_s)
        # Asynchronous over processes: rank 0 logs every worker's arrival itself, no means to take.
        self.log = RunLog(
            metrics, LocalBackend() if self._async_processes else self.backend, self.ledger, *timing
        )
        status = "failed"
        self.stop.install()
        try:
            self._log_start()
            metrics.start(progress.steps)
            if not progress.val_losses:
                self.evaluate()
            next_eval = _next_multiple(progress.steps, cfg.train.eval_every)
            next_ckpt = _next_multiple(progress.outer_steps, cfg.checkpoint.every)
            # The ranks agree on stopping once per H inner steps (dp: once per log line; signals.py).
            period = cfg.train.log_every if self.dp is not None else cfg.sync.every
            while self._goes_on(period):
                t0 = time.perf_counter()
                self.run_round()
                progress.train_s += time.perf_counter() - t0
                mid_run = progress.steps < self.total_steps and self._evaluates_mid_run
                if progress.steps >= next_eval and mid_run:
                    self.evaluate()
                    next_eval = _next_multiple(progress.steps, cfg.train.eval_every)
                done = progress.steps if self.dp is not None else progress.outer_steps
                if done >= next_ckpt and progress.steps < self.total_steps:
                    self.save_checkpoint()
                    next_ckpt = _next_multiple(done, cfg.checkpoint.every)
            stopped = self.stop.settle()
            if self.dp is None and not stopped:  # a swarm's final agreement, before the final eval
                self.engine.conclude(self.replicas, on_failure=self.save_checkpoint)
            if progress.val_losses[-1][0] != progress.steps and not stopped:
                self.evaluate()
            self.save_checkpoint()
            status = "completed" if not stopped else "interrupted"
            if self.backend.world_size > 1:
                # Every rank done before any tears its process groups down (gloo can abort otherwise).
                self.backend.barrier()
        except KeyboardInterrupt:
            status = "interrupted"  # a second Ctrl+C: leave at once, keep the last checkpoint
            raise
        finally:
            self.stop.restore()
            self.log.close()
            self.backend.close()
            self.reducer.close()
            summary = self.write_summary(status)
            if wandb_run is not None:
                finish_wandb(wandb_run, summary)
        return summary

    def run_round(self) -> None:
        """dp: one step. DiLoCo: inner steps up to the next sync event, then the engine's round there.
        Plain DiLoCo (one fragment, tau = 0): H inner steps, then one sync. Streaming: fragments start and
        finish at staggered steps; a sync started at t is applied at t + tau while the inner steps go on."""
        if self.dp is not None:
            self._dp_step()
            return
        if self.async_rounds is not None:  # no barrier: the next window to end (processes: ours), applied
            for record in self.async_rounds.next_records():
                self.log.sync(record)
            self.clock.virtual_s = self.async_rounds.virtual_s
            return
        end = min(self.engine.next_event(self.progress.steps), self.total_steps)

        # 1. Inner steps: each replica trains alone on its own data stream until the next event. A signal
        #    stops a single-process run after the current inner step: the replicas' own step counters
        #    (checkpointed) let the resumed run finish the segment where each one left off.
        with record_function("muloco::inner_steps"):
            self.inner.run_until(end)
        if any(replica.inner_steps < end for replica in self.replicas):
            return  # interrupted: the loop writes a checkpoint
        if self.probe is not None:  # diagnostics: the same steps on the union of the workers' batches
            t = self.cfg.train
            self.probe.train_until(
                end, self._lr_multiplier, self.micro_batches, self.seqs_per_micro, t.grad_clip, self.autocast
            )
        # The earlier syncs' records whose means have arrived; a record still waiting for its all-reduce
        # (a streaming round can be one inner step, shorter than a collective over a slow link) stays for
        # a later round rather than stop this one.
        self.log.flush(block=False)

        # 2. The sync event: the syncs due applied, the fragments scheduled started (engine.round). The
        #    first record of the round carries each worker's step time in it.
        step_times = round_step_times(self.replicas, self.cfg.workers, self.topology.is_lead)
        self.pacing.close_round(end, self.pacing.exchange(self.backend, step_times))
        for record in self.engine.round(end, self.replicas, round_loss=self._round_loss):
            self.log.sync(record, step_times)
            step_times = ()

    def _round_loss(self) -> SumCount:
        """The train losses since the last sync started, taken for the next one. With R ranks per worker
        each rank's losses are shares of the worker's: counted once."""
        losses, self.progress.round_losses = self.progress.round_losses, []
        if self.topology.sharded:  # every rank holds the worker's sum: a checkpoint saves it once
            return SumCount(self.engine.worker_sum(sum(losses))[0], len(losses))
        return SumCount(sum(losses), len(losses) if self.topology.is_lead else 0)

    def _dp_step(self) -> None:
        progress = self.progress
        loss_sum_count = self.dp.step(self._lr_multiplier(progress.steps), self.autocast)
        if progress.steps % self.cfg.train.log_every == 0 or progress.steps == self.total_steps:
            self.log.train(progress.steps, loss_sum_count)

    # -- helpers of the loop --------------------------------------------------------------------------
    def _goes_on(self, period: int) -> bool:
        """Whether the loop runs another round. Asynchronous over processes: until this worker is done
        (a signal reaches the parameter owner with its next window; param_owner.py), no agreement."""
        if self._async_processes:
            return not self.async_rounds.finished
        return self.progress.steps < self.total_steps and not self.stop.agreed_at(self.progress.steps, period)

    @property
    def _async_processes(self) -> bool:
        return self.async_rounds is not None and self.backend.world_size > 1

    @property
    def _evaluates_mid_run(self) -> bool:
        return self.async_rounds is None or self.async_rounds.evaluates_mid_run

    def tokens_at(self, step: int) -> int:
        """Tokens all workers trained up to inner step `step` (pacing by speed: each its share)."""
        if self.async_rounds is not None:  # the windows arrived so far
            return self.async_rounds.credited * self.cfg.worker_batch_tokens
        steps = self.pacing.worker_steps_until(step, self.total_steps)
        return steps * self.cfg.worker_batch_tokens

    def _lr_multiplier(self, step: int) -> float:
        t = self.cfg.train
        args = (t.warmup_steps, t.lr_schedule, t.min_lr_ratio, t.decay_fraction)
        return lr_multiplier(step, self.total_steps, *args)

    def evaluate(self) -> float:
        """Val loss of the global parameters (evaluate.py)."""
        # Streaming: the replicas hold fragments at different rounds, so the global parameters are evaluated.
        global_params = (
            self.engine.global_params if self.engine is not None and self.cfg.sync.streaming else None
        )
        if self.async_rounds is not None:  # rank 0 over processes: a copy (its owner's thread updates them)
            global_params = self.async_rounds.eval_params()
        val_loss = evaluate_global(self.replicas[0], global_params, self.val_set, self.device, self.autocast)
        self.progress.val_losses.append([self.progress.steps, val_loss])
        # train_s: the clock of a time-to-loss without the evaluations (experiments/wan/bench_wan.py)
        self.log.now("eval", self.progress.steps, val_loss=val_loss, train_s=round(self.progress.train_s, 3))
        return val_loss

    def _log_start(self) -> None:
        cfg, init = self.cfg, self.init_source
        fields = {
            **run_start_fields(cfg, self.run_dir, len(self.local_indices), self.device),
            **({"init": init.describe()} if init is not None else {}),
            "params": self.num_params,
            "data": self.data.description,
            "steps": self.total_steps,
            "sync_every": cfg.sync.every,
            "micro_batches": self.micro_batches,
            "batched": self.batched,
        }
        log_run_start(fields, self.replicas[0].optimizer, cfg.simulation.offload and self.offload is None)

    def save_checkpoint(self) -> Path:
        """Every component's state under its name, written atomically (checkpointing.py)."""
        self.log.flush()  # a resumed run starts its metrics after the checkpoint's step
        self.progress.elapsed_s = self.log.elapsed()
        return self.checkpoints.save(self.components, self.progress.steps, self.init_source)

    def write_summary(self, status: str) -> dict[str, Any]:
        """summary.json (summary.py): the config's key figures and every component's summary."""
        figures = {"num_params": self.num_params, "device": str(self.device), "status": status}
        figures["tokens"] = self.tokens_at(self.progress.steps)
        clock = {"elapsed_s": self.log.elapsed(), "train_time_s": self.progress.train_s}
        summary = build_summary(self.cfg, self.components, self.replicas, **figures, **clock)
        if self.is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary


def _next_multiple(value: int, every: int) -> float:
    return (value // every + 1) * every if every > 0 else math.inf


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job from a validated config; returns the summary (also written to summary.json)."""
    return Trainer(cfg).run()
