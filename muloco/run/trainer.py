"""The training loop. One DiLoCo round reads top to bottom in `Trainer.run_round`:

    inner steps -> engine.start (pseudogradients, compress, reduce started) -> engine.finish (wait, outer
    step, merge into the replicas) -> log; the loop then evaluates and checkpoints

A process hosts k >= 1 replicas of the run's K (DESIGN.md). The sync itself is the engine's (muloco/sync/);
which processes or peers it averages with is its reducer's (collectives over the local / torch backend,
or a hivemind swarm). `method: dp` is the data-parallel baseline (dp.py). The run's counters are
components (state.py) that checkpoint themselves. Reliability (interrupts, non-finite guards,
checkpoints): docs/reliability.md.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from muloco.checkpoint.plain import save_checkpoint
from muloco.checkpoint.sharded import save_sharded, with_ranks_rng
from muloco.comm import Backend, ProcessMeans, build_backend, means_over_processes
from muloco.comm.sharding import layout_free_fingerprint
from muloco.comm.topology import build_topology
from muloco.config import Config
from muloco.data import ReplicaStream, load_data, val_batches
from muloco.models import build_model, describe_model
from muloco.models.init import initialize
from muloco.net.wan import Link
from muloco.run.batched import use_batched
from muloco.run.build import (
    alignment_probe,
    autocast_factory,
    check_comm_hook_world,
    data_parallel,
    diloco_replicas,
    dp_replica,
    resolve_device,
    sync_engine,
)
from muloco.run.dp import DataParallel
from muloco.run.evaluate import evaluate_global
from muloco.run.inner_steps import InnerSteps
from muloco.run.lr_schedule import lr_multiplier
from muloco.run.metrics import MetricsLogger, finish_wandb, log_run_start, start_wandb, timed_record
from muloco.run.offload import ReplicaOffload, offload_applies
from muloco.run.pending_records import PendingRecords
from muloco.run.resume import check_same_config, load_components, resume_run
from muloco.run.run_dir import (
    prepare_run_dir,
    run_dir_of,
    write_json_atomic,
    write_resolved_config,
    write_tokenizer_record,
)
from muloco.run.signals import EXIT_INTERRUPTED, StopRequest
from muloco.run.state import CommLedger, Progress, RngState, StateList, WanProjection
from muloco.run.summary import build_summary
from muloco.run.threads import set_threads
from muloco.sync import Reducer, SyncEngine, SyncRecord, build_reducer

log = logging.getLogger("muloco")

__all__ = ["EXIT_INTERRUPTED", "Trainer", "train"]


class Trainer:
    def __init__(self, cfg: Config, backend: Backend | None = None) -> None:
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
        rank = self.backend.rank
        self.checkpoint_dir = self.run_dir / "checkpoints" / ("" if rank == 0 else f"rank{rank}")

        # Workers of R ranks each (comm/topology.py); the reducer says which replicas this process hosts.
        self.topology = build_topology(self.backend, cfg.ranks_per_worker, sharded=cfg.sharding == "fsdp")
        if self.topology.sharded:  # one checkpoint of every rank's shards (sharded_checkpoint.py)
            self.checkpoint_dir = self.run_dir / "checkpoints" / "sharded"
        self.reducer = build_reducer(cfg, self.topology)
        self.local_indices = self.reducer.local_replicas(K)

        seq_len = cfg.model.seq_len
        self.data = load_data(cfg.data, seq_len)
        self.total_steps = cfg.total_steps
        self.seqs_per_micro = (cfg.train.micro_batch_tokens or cfg.worker_batch_tokens) // seq_len
        self.micro_batches = cfg.worker_batch_tokens // (self.seqs_per_micro * seq_len)
        self.val_set = val_batches(self.data.val, seq_len, cfg.train.eval_tokens, self.seqs_per_micro)
        prepare_run_dir(cfg, self.backend)

        # Every replica starts from the same seeded initialization; with several processes rank 0's weights
        # are also broadcast (every process must take part), so all replicas start identical.
        torch.manual_seed(cfg.run.seed)
        template = build_model(cfg.model, self.data.vocab_size)
        self.init_source = initialize(template, cfg.model)  # pretrained or another run's weights, if named
        self.backend.broadcast([p.data for p in template.parameters()], src=0).wait()
        self.num_params = sum(p.numel() for p in template.parameters())
        self.offload = ReplicaOffload(self.device) if offload_applies(cfg, self.device) else None
        self.batched = cfg.method == "diloco" and use_batched(
            cfg.simulation.batched,
            self.device,
            len(self.local_indices),
            cfg.ranks_per_worker,
            offloaded=self.offload is not None,
        )
        streams = [ReplicaStream(self.data.train, seq_len, r, K, cfg.run.seed) for r in self.local_indices]

        # The run's state, as components that checkpoint themselves (run_state.py).
        self.progress = Progress()
        self.ledger = CommLedger(num_params=self.num_params)
        bandwidth = cfg.backend.local.bandwidth_mbps
        link = Link(bandwidth, cfg.backend.local.latency_ms) if bandwidth else None
        self.wan = WanProjection(link=link, progress=self.progress)
        self.engine: SyncEngine | None = None
        self.dp: DataParallel | None = None
        counters = {"progress": self.progress, "ledger": self.ledger, "wan": self.wan}
        if cfg.method == "dp":
            self.replicas = [dp_replica(cfg, template, self.local_indices[0], streams[0], self.device)]
            shape = (self.micro_batches, self.seqs_per_micro)
            self.dp = data_parallel(cfg, self.replicas[0], streams, self.backend, shape, **counters)
        else:
            self.replicas = diloco_replicas(
                cfg, template, self.local_indices, streams, self.device, self.topology, self.offload
            )
            # Sharded: the engine holds this rank's rows of the wrapped model's parameters.
            initial = self.replicas[0].model if self.topology.sharded else template
            shards = self.topology.worker if self.topology.sharded else None
            self.engine = sync_engine(
                cfg, initial, self.reducer, self.replicas, self.device, shard_group=shards, **counters
            )
        probing = cfg.diagnostics.alignment
        self.probe = alignment_probe(cfg, template, self.data.train, self.device) if probing else None
        self.autocast = autocast_factory(cfg.train.precision, self.device)
        self.stop = StopRequest(self.backend)
        self._pending_records = PendingRecords()  # _log_later's, written by _write_pending
        shape = (self.micro_batches, self.seqs_per_micro, cfg.train.grad_clip)
        inner_args = (self.progress, self.stop, self._lr_multiplier, shape, self.autocast, self.offload)
        self.inner = InnerSteps(self.replicas, *inner_args, batched=self.batched)
        self.components = {
            "progress": self.progress,
            "ledger": self.ledger,
            "wan": self.wan,
            "replicas": StateList(self.replicas),
            "rng": RngState(self.device),
            **({"engine": self.engine} if self.engine is not None else {"dp": self.dp}),
            **({"membership": self.reducer.membership} if hasattr(self.reducer, "membership") else {}),
        }
        self.resumed_from: Path | None = None
        self._resume()
        if self.engine is not None:
            if self.probe is not None:
                self.engine.observer = self.probe
                self.probe.restart_from(self.engine.global_params, self.replicas[0].stream.position)
            self.engine.join(self.replicas, resumed=self.resumed_from is not None)
        if self.is_main:
            write_resolved_config(cfg, self.run_dir)
            write_tokenizer_record(self.run_dir, self.data)

    # -- set-up helpers -------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Every component from the checkpoint that `checkpoint.resume` names (resume.py), if any."""
        model = self.replicas[0].model
        where = (self.run_dir, self.checkpoint_dir, self.local_indices, model)
        found = resume_run(self.cfg, self.backend, self.topology, *where)
        if found is None:
            return
        path, state = found
        if self.init_source is not None:
            self.init_source.check_resumed(state.get("init_digest"), path)
        load_components(self.components, state, path)
        self.resumed_from, progress = path, self.progress
        log.info("resumed checkpoint=%s step=%d outer_steps=%d", path, progress.steps, progress.outer_steps)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, progress = self.cfg, self.progress
        wandb_run = start_wandb(cfg, self.run_dir) if cfg.logging.wandb and self.is_main else None
        resume_step = progress.steps if self.resumed_from else None
        where = (self.run_dir / "metrics.jsonl", self.total_steps, cfg.logging.progress, wandb_run)
        self.metrics = MetricsLogger(*where, resume_step, self.is_main)
        self.started, self.elapsed_at_start = time.perf_counter(), progress.elapsed_s
        status = "failed"
        self.stop.install()
        try:
            self._log_start()
            self.metrics.start(progress.steps)
            if not progress.val_losses:
                self.evaluate()
            next_eval = _next_multiple(progress.steps, cfg.train.eval_every)
            next_ckpt = _next_multiple(progress.outer_steps, cfg.checkpoint.every)
            while progress.steps < self.total_steps and not (self._agreement_due() and self.stop.agreed()):
                t0 = time.perf_counter()
                self.run_round()
                progress.train_s += time.perf_counter() - t0
                if progress.steps >= next_eval and progress.steps < self.total_steps:
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
            self.metrics.close()
            self.backend.close()
            self.reducer.close()
            summary = self.write_summary(status)
            if wandb_run is not None:
                finish_wandb(wandb_run, summary)
        return summary

    def _agreement_due(self) -> bool:
        """Whether the ranks agree on stopping after this round: once per H inner steps (DiLoCo: plain
        DiLoCo's every round, streaming's every 2P-th), once per log line (dp), every round in a single
        process (no collective). Every rank answers the same: a signal stops the run within two periods."""
        if self.backend.world_size == 1:
            return True
        period = self.cfg.train.log_every if self.dp is not None else self.cfg.sync.every
        return self.progress.steps % period == 0

    def run_round(self) -> None:
        """dp: one step. DiLoCo: inner steps up to the next sync event, then the syncs due at that step.
        Plain DiLoCo (one fragment, tau = 0): H inner steps, then one sync. Streaming: fragments start and
        finish at staggered steps; a sync started at t is applied at t + tau while the inner steps go on."""
        if self.dp is not None:
            self._dp_step()
            return
        engine, progress = self.engine, self.progress
        end = min(engine.next_event(progress.steps), self.total_steps)

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
        progress.steps = end
        # The earlier syncs' records whose means have arrived; a record still waiting for its all-reduce
        # (a streaming round can be one inner step, shorter than a collective over a slow link) stays for
        # a later round rather than stop this one.
        self._write_pending(block=False)
        engine.trained()

        # 2. Syncs in flight that are due are applied first (at the last step: all of them); then the
        #    fragments scheduled now start theirs (at the last step: every fragment with unsynced steps).
        #    With R ranks per worker each rank's losses are shares of the worker's: counted once.
        finishing, starting = engine.due(progress.steps)
        for sync in finishing:
            self._log_sync(engine.finish(sync, self.replicas))
        contributing = self.replicas
        while starting:
            fragment, starting = starting[0], starting[1:]
            losses, step = progress.round_losses, progress.steps
            loss_sum_count = (sum(losses), len(losses) if self.topology.is_lead else 0)
            if self.topology.sharded:  # every rank holds the worker's sum: a checkpoint saves it once
                loss_sum_count = (engine.worker_sum(sum(losses))[0], len(losses))
            sync = engine.start(fragment, contributing, step, {"loss_sum_count": loss_sum_count})
            progress.round_losses = []
            if sync.apply_step <= progress.steps:
                self._log_sync(engine.finish(sync, self.replicas))
            replanned = engine.replan_if_moved(sync, fragment, step, last=step >= self.total_steps)
            if replanned is not None:  # torchft: adopted its quorum's state and step; nothing of its own
                starting, contributing = replanned, []

    def _log_sync(self, record: SyncRecord) -> None:
        sums = record.sums
        means = means_over_processes(self.backend, sums["loss_sum_count"], sums["norm_sum_count"])
        self._log_later("sync", record.step, means, ("train_loss", "pseudograd_norm"), record.fields)

    def _dp_step(self) -> None:
        progress, t = self.progress, self.cfg.train
        loss_sum_count = self.dp.step(self._lr_multiplier(progress.steps), self.autocast)
        if progress.steps % t.log_every == 0 or progress.steps == self.total_steps:
            self._write_pending(block=False)  # earlier log lines' means, those that have arrived
            means = means_over_processes(self.backend, loss_sum_count)
            self._log_later("train", progress.steps, means, ("train_loss",), {})

    # -- helpers of the loop --------------------------------------------------------------------------
    def _lr_multiplier(self, step: int) -> float:
        t = self.cfg.train
        args = (t.warmup_steps, t.lr_schedule, t.min_lr_ratio, t.decay_fraction)
        return lr_multiplier(step, self.total_steps, *args)

    def evaluate(self) -> float:
        """Val loss of the global parameters (evaluate.py)."""
        # Streaming: the replicas hold fragments at different rounds, so the global parameters are evaluated.
        streaming = self.engine is not None and self.cfg.sync.streaming
        global_params = self.engine.global_params if streaming else None
        val_loss = evaluate_global(self.replicas[0], global_params, self.val_set, self.device, self.autocast)
        self.progress.val_losses.append([self.progress.steps, val_loss])
        # train_s: the clock of a time-to-loss without the evaluations (experiments/wan/bench_wan.py)
        self._log("eval", val_loss=val_loss, train_s=round(self.progress.train_s, 3))
        return val_loss

    def _elapsed(self) -> float:
        return self.elapsed_at_start + time.perf_counter() - self.started

    def _log(self, kind: str, step: int | None = None, **values: Any) -> None:
        """One metrics.jsonl record at `step` (default: now), after the records still waiting."""
        self._write_pending()
        steps = self.progress.steps if step is None else step
        self.metrics.log(timed_record(kind, steps, *self._timing(), **values))

    def _log_later(
        self, kind: str, step: int, means: ProcessMeans, names: tuple[str, ...], fields: dict
    ) -> None:
        """A record whose means over the processes are still on their way (means_over_processes), timed
        now and written by `_write_pending` once they are there (at the latest before the next record or
        checkpoint): over a slow link its all-reduce would otherwise cost every sync a round trip."""
        self._pending_records.add(kind, step, self._timing(), means, names, fields)

    def _write_pending(self, block: bool = True) -> None:
        """The records waiting for their means (pending_records.py); a blocking wait is time on the
        network (summary.json's comm_wait_s)."""
        self.ledger.comm_wait_s += self._pending_records.flush(self.metrics.log, block)

    def _timing(self) -> tuple:
        return self.cfg.train.batch_tokens, self.total_steps, self._elapsed(), self.ledger.bytes_sent

    def _log_start(self) -> None:
        cfg = self.cfg
        fields = {
            "run": cfg.run.name,
            "dir": self.run_dir,
            "method": cfg.method if cfg.dp.comm_hook == "none" else f"dp+{cfg.dp.comm_hook}",
            "inner": cfg.inner.optimizer,
            "workers": cfg.workers,
            "local_replicas": len(self.local_indices),
            "device": self.device,
            "model": describe_model(cfg.model),
            **({"init": self.init_source.describe()} if self.init_source is not None else {}),
            "params": self.num_params,
            "data": self.data.description,
            "steps": self.total_steps,
            "sync_every": cfg.sync.every,
            "micro_batches": self.micro_batches,
            "batched": self.batched,
        }
        log_run_start(fields, self.replicas[0].optimizer, cfg.simulation.offload and self.offload is None)

    def save_checkpoint(self) -> Path:
        """Every component's state under its name, written atomically (checkpoint.py)."""
        self._write_pending()  # a resumed run starts its metrics after the checkpoint's step
        self.progress.elapsed_s = self._elapsed()
        state = {"fingerprint": self.cfg.fingerprint(), "local_indices": self.local_indices}
        if self.init_source is not None:
            state["init_digest"] = self.init_source.digest
        state.update({name: component.state_dict() for name, component in self.components.items()})
        step, keep = self.progress.steps, self.cfg.checkpoint.keep
        with record_function("muloco::checkpoint"):
            if self.topology.sharded:
                path = self._save_sharded(state, step, keep)
            else:
                path = save_checkpoint(state, self.checkpoint_dir, step, keep)
        log.info("checkpoint path=%s step=%d", path, self.progress.steps)
        return path

    def _save_sharded(self, state: dict[str, Any], step: int, keep: int) -> Path:
        """A collective of every rank (checkpoint/sharded.py)."""
        info = {"layout_fingerprint": layout_free_fingerprint(self.cfg), "workers": self.cfg.workers}
        prefix, topology = f"replica{self.local_indices[0]}", self.topology
        state, lead = with_ranks_rng(state, topology.worker), topology.is_lead
        return save_sharded(state, self.checkpoint_dir, step, keep, self.backend, prefix, lead, info)

    def write_summary(self, status: str) -> dict[str, Any]:
        """summary.json (summary.py): the config's key figures and every component's summary."""
        summary = build_summary(
            self.cfg,
            self.components,
            self.replicas,
            num_params=self.num_params,
            device=str(self.device),
            elapsed_s=self._elapsed(),
            train_time_s=self.progress.train_s,
            status=status,
        )
        if self.is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary


def _next_multiple(value: int, every: int) -> float:
    return (value // every + 1) * every if every > 0 else math.inf


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job from a validated config; returns the summary (also written to summary.json)."""
    return Trainer(cfg).run()
