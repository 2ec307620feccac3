"""The training loop. One DiLoCo round reads top to bottom in `Trainer._diloco_round` and the two halves of
a sync it calls, `_start_sync` and `_finish_sync`:

    inner steps -> pseudogradients -> compress -> reduce (started) -> outer step -> merge into replicas
    -> eval/log/checkpoint

A process hosts k >= 1 replicas of the run's K (DESIGN.md). With the local backend k = K (simulation); the
torch backend and hivemind peers (muloco/peer.py) only change how `_start_mean` averages across processes,
and workers of R ranks (comm/topology.py) how a worker's ranks share it. Plain DiLoCo syncs every parameter
every H steps and applies it at once; Streaming DiLoCo syncs fragments at staggered steps and applies each
tau steps later (schedule.py). `method: dp` is the data-parallel baseline: one model whose gradients are
averaged over the K workers' batches every step. Reliability (interrupts, non-finite guards, checkpoints):
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

import muloco
from muloco.alignment import AlignmentProbe, UnionStream
from muloco.checkpoint import (
    checkpoint_step,
    find_resume_state,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from muloco.codec import PseudogradientCodec
from muloco.comm import Backend, build_backend, ring_allgather_bytes, ring_allreduce_bytes
from muloco.comm.topology import build_topology
from muloco.compress import ErrorFeedback
from muloco.config import Config
from muloco.data import ReplicaStream, load_data, val_batches
from muloco.errors import CheckpointError, TrainingError, UserError
from muloco.lr_schedule import lr_multiplier
from muloco.metrics import MetricsLogger, start_wandb
from muloco.models import ParamRole, build_model, param_roles
from muloco.optim import build_inner_optimizer
from muloco.outer import OuterOptimizer
from muloco.peer import SwarmPeer, peer_index
from muloco.reduce import PendingMean, share_with_worker, start_mean_compressed, start_mean_uncompressed
from muloco.replica import Replica, forward_backward, set_lr_multiplier
from muloco.run_dir import prepare_run_dir, write_json_atomic, write_resolved_config
from muloco.schedule import InFlightSync, SyncSchedule, assign_fragments
from muloco.wan import Link, allreduce_seconds, sync_seconds

log = logging.getLogger("muloco")

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors taken as one vector (one host sync, not one per tensor)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).item()


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was asked for but no CUDA device is available; use device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: Config, backend: Backend | None = None) -> None:
        self.cfg = cfg
        self.backend = backend or build_backend(cfg)
        self.is_main = self.backend.rank == 0
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.run_dir = prepare_run_dir(cfg)
        self._check_same_config_on_every_rank()
        rank = self.backend.rank
        self.checkpoint_dir = self.run_dir / "checkpoints" / ("" if rank == 0 else f"rank{rank}")

        # Workers of R ranks each (R = 1: one process per worker group, DESIGN.md); a worker group of
        # processes hosts K / G of the replicas.
        self.topology = build_topology(self.backend, cfg.ranks_per_worker)
        K, G, g = cfg.workers, self.topology.num_workers, self.topology.worker_index
        if K % G != 0:
            raise UserError(
                f"workers ({K}) must be divisible by the number of processes / ranks_per_worker ({G}); "
                "change workers"
            )
        self.local_indices = list(range(g * (K // G), (g + 1) * (K // G)))
        if cfg.backend.kind == "hivemind":
            self.local_indices = [peer_index(cfg)]  # one replica per peer: its data shard

        seq_len = cfg.model.seq_len
        self.data = load_data(cfg.data, seq_len)
        self.total_steps = cfg.total_steps
        self.seqs_per_micro = (cfg.train.micro_batch_tokens or cfg.worker_batch_tokens) // seq_len
        self.micro_batches = cfg.worker_batch_tokens // (self.seqs_per_micro * seq_len)
        self.val_set = val_batches(self.data.val, seq_len, cfg.train.eval_tokens, self.seqs_per_micro)

        # Every replica starts from the same seeded initialization; with several processes rank 0's weights
        # are also broadcast (every process must take part), so all replicas start identical.
        torch.manual_seed(cfg.run.seed)
        template = build_model(cfg.model, self.data.vocab_size)
        self.backend.broadcast([p.data for p in template.parameters()], src=0).wait()
        self.num_params = sum(p.numel() for p in template.parameters())
        self.offload = cfg.simulation.offload and self.device.type == "cuda"
        streams = [ReplicaStream(self.data.train, seq_len, r, K, cfg.run.seed) for r in self.local_indices]
        self.replicas, self.dp_streams = self._build_replicas(template, streams)
        self.outer = self._build_outer(template) if cfg.method == "diloco" else None
        self.probe = self._build_probe(template) if cfg.diagnostics.alignment else None
        self.fragments, self.codecs = self._build_fragments(template) if self.outer else ([], [])
        self.schedule = SyncSchedule(cfg.sync.every, cfg.sync.fragments, cfg.sync.overlap)
        self.swarm = None
        if cfg.backend.kind == "hivemind":
            shapes = [[self.outer.params[i].shape for i in indices] for indices in self.fragments]
            self.swarm = SwarmPeer(cfg, shapes, self.codecs)
        bandwidth = cfg.backend.local.bandwidth_mbps
        self.link = Link(bandwidth, cfg.backend.local.latency_ms) if bandwidth else None
        self.autocast = self._autocast_factory()

        # Counters that a checkpoint carries.
        self.step = 0  # inner steps taken by every replica
        self.outer_steps = 0
        self.fragment_syncs = 0  # = outer_steps x P with streaming fragments
        self.bytes_sent = 0.0  # per worker
        self.peak_bytes_per_sync = 0.0  # per worker, the largest single sync event
        self.payload_by_fragment: dict[int, float] = {}  # one replica's message of the latest sync
        self.in_flight: list[InFlightSync] = []
        self.unsynced = [False] * len(self.fragments)  # inner steps not yet covered by a started sync
        self.round_losses: list[float] = []  # train losses since the last sync started
        self.bad_syncs = 0  # syncs in a row that left a non-finite replica out
        self.comm_wait_s = 0.0  # time blocked waiting for reductions
        self.worker_compute_s = 0.0  # one worker's inner-step compute (mean over replicas), all sessions
        self.projected_network_s = 0.0  # WAN planner (backend.local.bandwidth_mbps): transfer time
        self.projected_wait_s = 0.0  # ... and the part of it not hidden behind overlapped inner steps
        self.elapsed_before = 0.0  # wall time of earlier sessions of this run (resume)
        self.val_losses: list[tuple[int, float]] = []
        self.stop_signal: int | None = None
        self.resumed_from: Path | None = None
        self._resume()
        if self.probe is not None:
            self.probe.restart_from(self.outer.params, self.replicas[0].stream.position)
        if self.swarm is not None:
            self._join_swarm()
        if self.is_main:
            write_resolved_config(cfg, self.run_dir)

    # -- set-up helpers -------------------------------------------------------------------------------
    def _build_replicas(self, template, streams) -> tuple[list[Replica], list]:
        """DiLoCo: one replica (model copy + inner optimizer + stream) per local worker. DP: one model whose
        micro-batches are the K workers' batches, so the maths is K-worker data parallelism."""
        cfg = self.cfg
        if cfg.method == "dp":
            model = template.to(self.device)
            replica = Replica(
                self.local_indices[0], model, build_inner_optimizer(model, cfg.inner), streams[0], self.device
            )
            return [replica], streams
        home = torch.device("cpu") if self.offload else self.device
        worker = self.topology.worker
        # Distributed Muon: each matrix's momentum and Newton-Schulz on one rank of the worker.
        owners = worker.group if worker is not None and cfg.inner.distributed_muon else None
        replicas = []
        for index, stream in zip(self.local_indices, streams, strict=True):
            model = copy.deepcopy(template).to(home)
            optimizer = build_inner_optimizer(model, cfg.inner, process_group=owners)
            replica = Replica(index, model, optimizer, stream, self.device)
            if worker is not None:
                replica.worker = worker
                replica.shard_index, replica.shard_count = self.topology.local_rank, worker.world_size
            if cfg.compression.error_feedback and cfg.compression.scheme != "none":
                replica.error_feedback = ErrorFeedback(cfg.compression.ef_decay, cfg.compression.ef_alpha)
            replicas.append(replica)
        return replicas, []

    def _build_probe(self, template) -> AlignmentProbe:
        """diagnostics.alignment: a replica on the union of the K workers' batches (alignment.py)."""
        cfg, K = self.cfg, self.cfg.workers
        streams = [ReplicaStream(self.data.train, cfg.model.seq_len, r, K, cfg.run.seed) for r in range(K)]
        model = copy.deepcopy(template).to(self.device)
        optimizer = build_inner_optimizer(model, cfg.inner)
        replica = Replica(-1, model, optimizer, UnionStream(streams), self.device)
        roles = param_roles(model)
        matrices = [i for i, (n, _) in enumerate(model.named_parameters()) if roles[n] == ParamRole.MATRIX]
        return AlignmentProbe(replica, matrices)

    def _build_fragments(self, template) -> tuple[list[list[int]], list[PseudogradientCodec]]:
        """Parameter indices of each sync fragment (one fragment unless streaming) and, with compression,
        one codec per fragment."""
        sync = self.cfg.sync
        names = [name for name, _ in template.named_parameters()]
        try:
            owner = assign_fragments(
                names, sync.fragments, sync.fragment_pattern, sync.embedding_fragment, sync.head_fragment
            )
        except ValueError as exc:
            raise UserError(str(exc)) from None
        fragments = [[i for i, p in enumerate(owner) if p == f] for f in range(sync.fragments)]
        codecs = []
        if self.cfg.compression.scheme != "none":
            roles = param_roles(template)
            for indices in fragments:
                subset = [names[i] for i in indices]
                codecs.append(PseudogradientCodec.from_config(subset, roles, self.cfg.compression))
        return fragments, codecs

    # -- hivemind: one peer of a swarm (muloco/peer.py) ----------------------------------------------------
    def _join_swarm(self) -> None:
        """A peer joining a running swarm (and without a checkpoint of its own) first loads the swarm's
        global parameters, outer momentum and step counters; then it serves its own to later joiners and
        waits for backend.hivemind.wait_for_peers peers."""
        if self.resumed_from is None and self.cfg.backend.hivemind.initial_peers:
            self._load_swarm_state()
        self._serve_swarm_state()
        self.swarm.wait_for_peers(self.fragment_syncs)

    def _load_swarm_state(self) -> bool:
        """Global parameters, outer momentum and step counters from a peer; the replicas restart there."""
        found = self.swarm.load_state()
        if found is None:
            return False
        tensors, meta = found
        n = len(self.outer.params)
        self.outer.load_state_dict(
            {"names": self.outer.names, "params": tensors[:n], "momentum_buffers": tensors[n:]}
        )
        self.step, self.outer_steps = meta["step"], meta["outer_steps"]
        self.fragment_syncs = meta["fragment_syncs"]
        for replica in self.replicas:
            replica.load_global(self.outer.params)
            replica.inner_steps = self.step
        self.round_losses = []
        log.info("hivemind: loaded the swarm's state: step=%d outer_steps=%d", self.step, self.outer_steps)
        return True

    def _serve_swarm_state(self) -> None:
        meta = {"step": self.step, "outer_steps": self.outer_steps, "fragment_syncs": self.fragment_syncs}
        self.swarm.serve([*self.outer.params, *self.outer.momentum_buffers], meta)

    def _catch_up_with_the_swarm(self, missed_group: bool) -> None:
        """A peer that is behind the swarm (it cannot average with peers at another step), or that found no
        group while other peers are there (it applied its own pseudogradient, so its global parameters left
        the swarm's), loads the swarm's state and continues from there."""
        if not missed_group:
            self._serve_swarm_state()  # a peer that went its own way does not offer its state to joiners
        for _ in range(3):  # a donor may still hold the previous sync's state: look again
            ahead = self.swarm.publish_and_check(self.fragment_syncs)
            realign = missed_group and self.swarm.others_in_step(self.fragment_syncs)
            if (ahead is None and not realign) or self.in_flight or self.step >= self.total_steps:
                return
            why = (
                "found no group"
                if ahead is None
                else f"is behind ({self.fragment_syncs} syncs, the swarm {ahead})"
            )
            log.warning("hivemind: this peer %s: loading the swarm's state", why)
            if not self._load_swarm_state():
                return
            self._serve_swarm_state()
            missed_group = False
            time.sleep(0.2)

    def _build_outer(self, template) -> OuterOptimizer:
        outer = self.cfg.outer
        device = torch.device("cpu") if outer.offload == "cpu" else self.device
        return OuterOptimizer(
            list(template.named_parameters()), outer.lr, outer.momentum, outer.nesterov, device
        )

    def _autocast_factory(self):
        precision = self.cfg.train.precision
        use_bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        if not use_bf16:
            return contextlib.nullcontext
        return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _check_same_config_on_every_rank(self) -> None:
        """A collective every rank calls first: ranks launched with different configs stop, all of them."""
        if self.backend.world_size == 1:
            return
        mine = self.cfg.fingerprint()
        fingerprints = [p.decode() for p in self.backend.all_gather_bytes(mine.encode()).wait()]
        if len(set(fingerprints)) > 1:
            raise UserError(
                f"the config differs across ranks (fingerprints by rank: {', '.join(fingerprints)}); "
                "start every rank with the same config file and KEY=VALUE overrides"
            )

    def _find_common_checkpoint(self) -> tuple[Path, dict] | None:
        """resume: auto with several processes (collectives: every rank calls them). A process killed
        mid-run leaves the ranks at different newest checkpoints: take the newest step that every rank
        holds and can read, falling back step by step."""
        mine = {checkpoint_step(p): p for p in list_checkpoints(self.checkpoint_dir)}
        lists = self.backend.all_gather_bytes(json.dumps(sorted(mine)).encode()).wait()
        common = set(mine)
        for other in lists:
            common &= set(json.loads(other))
        for step in sorted(common, reverse=True):
            try:
                found = (mine[step], load_checkpoint(mine[step]))
            except CheckpointError as exc:
                log.warning("skipping unreadable checkpoint path=%s reason=%s", mine[step], exc)
                found = None
            readable = self.backend.all_gather_bytes(b"1" if found else b"0").wait()
            if all(flag == b"1" for flag in readable):
                if step != max(mine):
                    log.warning("resuming from step %d, the newest checkpoint every rank holds", step)
                return found
        if any(json.loads(other) for other in lists):
            raise CheckpointError(
                f"no checkpoint step is held and readable by every rank (under "
                f"{self.run_dir / 'checkpoints'}); set checkpoint.resume=never to start over"
            )
        return None

    def _resume(self) -> None:
        if self.backend.world_size > 1 and self.cfg.checkpoint.resume == "auto":
            found = self._find_common_checkpoint()
        else:
            found = find_resume_state(self.cfg.checkpoint.resume, self.checkpoint_dir)
        if self.backend.world_size > 1:
            # Every rank must resume from the same step (collective: all ranks call it).
            step = str(found[1]["step"] if found else -1).encode()
            steps = [int(s) for s in self.backend.all_gather_bytes(step).wait()]
            if len(set(steps)) > 1:
                raise CheckpointError(
                    f"ranks found checkpoints of different steps to resume from ({steps}); give every rank "
                    "the same checkpoint.resume step, or set checkpoint.resume=never"
                )
        if found is None:
            return
        path, state = found
        if state.get("fingerprint") != self.cfg.fingerprint():
            raise CheckpointError(
                f"checkpoint {path} was written with a different config; resume with the same config, "
                "or pick a new run.name (or checkpoint.resume=never to start over)"
            )
        if state.get("local_indices") != self.local_indices:
            raise CheckpointError(
                f"checkpoint {path} holds replicas {state.get('local_indices')}, not {self.local_indices}"
            )
        for replica, replica_state in zip(self.replicas, state["replicas"], strict=True):
            replica.load_state_dict(replica_state)
        for stream, stream_state in zip(self.dp_streams, state["dp_streams"], strict=True):
            stream.load_state_dict(stream_state)
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.step, self.outer_steps = state["step"], state["outer_steps"]
        self.bytes_sent, self.elapsed_before = state["bytes_sent"], state["elapsed_s"]
        sync = state["sync"]  # (checkpoints of muloco <= 0.1 lack it and cannot resume streaming runs)
        self.fragment_syncs, self.unsynced = sync["fragment_syncs"], sync["unsynced"]
        self.in_flight = [InFlightSync.from_state_dict(s) for s in sync["in_flight"]]
        self.round_losses, self.comm_wait_s = sync["round_losses"], sync["comm_wait_s"]
        self.bad_syncs = sync["bad_syncs"]
        self.peak_bytes_per_sync = sync["peak_bytes_per_sync"]
        self.payload_by_fragment = dict(sync["payload_by_fragment"])
        self.worker_compute_s = sync["worker_compute_s"]
        self.projected_network_s = sync["projected_network_s"]
        self.projected_wait_s = sync["projected_wait_s"]
        self.val_losses = [tuple(v) for v in state["val_losses"]]
        self.resumed_from = path
        log.info("resumed checkpoint=%s step=%d outer_steps=%d", path, self.step, self.outer_steps)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        wandb_run = start_wandb(cfg, self.run_dir) if cfg.logging.wandb and self.is_main else None
        self.metrics = MetricsLogger(
            self.run_dir / "metrics.jsonl",
            self.total_steps,
            cfg.logging.progress,
            wandb_run,
            resume_step=self.step if self.resumed_from else None,
            enabled=self.is_main,
        )
        self.started = time.perf_counter()
        self.train_time = 0.0
        status = "failed"
        previous_handlers = self._install_signal_handlers()
        try:
            self._log_start()
            self.metrics.start(self.step)
            if not self.val_losses:
                self._evaluate()
            next_eval = self._next_multiple(self.step, cfg.train.eval_every)
            next_ckpt = self._next_multiple(self.outer_steps, cfg.checkpoint.every)
            while self.step < self.total_steps and not self._stop_requested():
                t0 = time.perf_counter()
                if cfg.method == "dp":
                    self._dp_step()
                else:
                    self._diloco_round()
                self.train_time += time.perf_counter() - t0
                if self.step >= next_eval and self.step < self.total_steps:
                    self._evaluate()
                    next_eval = self._next_multiple(self.step, cfg.train.eval_every)
                progress = self.step if cfg.method == "dp" else self.outer_steps
                if progress >= next_ckpt and self.step < self.total_steps:
                    self._save_checkpoint()
                    next_ckpt = self._next_multiple(progress, cfg.checkpoint.every)
            if self.val_losses[-1][0] != self.step and self.stop_signal is None:
                self._evaluate()
            self._save_checkpoint()
            status = "completed" if self.stop_signal is None else "interrupted"
            if self.backend.world_size > 1:
                # Every rank done before any tears its process groups down (gloo can abort otherwise).
                self.backend.barrier()
        except KeyboardInterrupt:
            status = "interrupted"  # a second Ctrl+C: leave at once, keep the last checkpoint
            raise
        finally:
            self._restore_signal_handlers(previous_handlers)
            self.metrics.close()
            self.backend.close()
            if self.swarm is not None:
                self.swarm.close()
            summary = self._write_summary(status)
            if wandb_run is not None:
                wandb_run.summary.update(
                    {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
                )
                wandb_run.finish()
        return summary

    def _diloco_round(self) -> None:
        """Inner steps up to the next sync event, then the syncs due at that step. Plain DiLoCo (one fragment,
        tau = 0): H inner steps, then one sync. Streaming: fragments start and finish at staggered steps
        (schedule.py); a sync started at t is applied at t + tau while the inner steps go on."""
        cfg = self.cfg
        end = min(self._next_sync_event(), self.total_steps)

        # 1. Inner steps: each replica trains alone on its own data stream until the next event. A signal
        #    stops a single-process run after the current inner step: the replicas' own step counters
        #    (checkpointed) let the resumed run finish the segment where each one left off.
        segment_times = []
        with record_function("muloco::inner_steps"):
            for replica in self.replicas:
                self._activate(replica)
                t0 = time.perf_counter()
                while replica.inner_steps < end and not self._stop_now():
                    loss = replica.train_step(
                        self.micro_batches,
                        self.seqs_per_micro,
                        self._lr_multiplier(replica.inner_steps),
                        cfg.train.grad_clip,
                        self.autocast,
                    )
                    replica.inner_steps += 1
                    if math.isfinite(loss):
                        self.round_losses.append(loss)
                    elif replica.healthy:
                        replica.healthy = False
                        log.warning(
                            "replica=%d step=%d: non-finite loss %s", replica.index, replica.inner_steps, loss
                        )
                segment_times.append(time.perf_counter() - t0)
                replica.compute_time_s += segment_times[-1]
                self._deactivate(replica)
        self.worker_compute_s += sum(segment_times) / len(segment_times)
        if any(replica.inner_steps < end for replica in self.replicas):
            return  # interrupted: the loop writes a checkpoint
        if self.probe is not None:  # diagnostics: the same steps on the union of the workers' batches
            self.probe.train_until(
                end,
                self._lr_multiplier,
                self.micro_batches,
                self.seqs_per_micro,
                cfg.train.grad_clip,
                self.autocast,
            )
        self.step = end
        self.unsynced = [True] * len(self.fragments)

        # 2. Syncs in flight that are due are applied first (at the last step: all of them). Then the
        #    fragments scheduled now start theirs; at the last step every fragment with unsynced steps
        #    syncs at once, so the final global parameters hold every worker's last steps.
        last = self.step >= self.total_steps
        for sync in [s for s in self.in_flight if last or s.apply_step <= self.step]:
            self._finish_sync(sync)
        due = self.schedule.starting_at(self.step)
        if last:
            due = [p for p, unsynced in enumerate(self.unsynced) if unsynced]
        for fragment in due:
            sync = self._start_sync(fragment, delay=0 if last else cfg.sync.overlap)
            if sync.apply_step <= self.step:
                self._finish_sync(sync)

    def _start_sync(self, fragment: int, delay: int) -> InFlightSync:
        """Steps 2-3 of a sync: the fragment's pseudogradients, compressed, and their mean started."""
        K = self.cfg.workers
        indices = self.fragments[fragment]
        codec = self.codecs[fragment] if self.codecs else None
        global_params = [self.outer.params[i] for i in indices]

        # 2. Pseudogradients delta_k = theta_global - theta_k. Uncompressed: summed over this process's
        #    replicas. Compressed: each replica encodes its own message, exactly what a node would send.
        #    The sum of unit vectors gives the mean pairwise cosine: sum_{j!=k} u_j.u_k = |sum u|^2 - k.
        with record_function("muloco::pseudogradients"):
            k_local = len(self.replicas)
            delta_sum = [torch.zeros_like(p) for p in global_params] if codec is None else None
            unit_sum = [torch.zeros_like(p) for p in global_params] if k_local > 1 else None
            norms, messages, healthy = [], [], 0
            for replica in self.replicas:
                self._activate(replica)
                delta = replica.pseudogradient(self.outer.params, indices)
                norm = global_norm(delta)
                if not (replica.healthy and math.isfinite(norm)):
                    # Left out of this sync (the mean is over the healthy replicas) and restarted from
                    # the global parameters with a fresh inner state.
                    log.warning(
                        "replica=%d step=%d: non-finite loss or pseudogradient (norm %s): left out of "
                        "this sync and reset to the global parameters",
                        replica.index,
                        self.step,
                        norm,
                    )
                    replica.reset_to(self.outer.params)
                    self._deactivate(replica)
                    continue
                healthy += 1
                norms.append(norm)
                if unit_sum is not None:
                    torch._foreach_add_(unit_sum, delta, alpha=1.0 / max(norm, 1e-30))
                if codec is None:
                    torch._foreach_add_(delta_sum, delta)
                else:
                    messages.append(codec.encode(delta, replica.error_feedback))
                if self.probe is not None:
                    self.probe.observe(delta)
                del delta
                self._deactivate(replica)
        self.unsynced[fragment] = False

        # 3. Start the mean over all K replicas. Every process must call these collectives, in the same
        #    order; the local backend completes at once, torch.distributed works in the background.
        with record_function("muloco::reduce"):
            numel = sum(p.numel() for p in global_params)
            result = self._start_mean(fragment, delta_sum, codec, messages, healthy, global_params)
            if codec is None:
                payload_bytes = 4 * numel
                sent = ring_allreduce_bytes(payload_bytes, K)
            else:
                payload_bytes = sum(len(m) for m in messages) / len(messages) if messages else 0.0
                sent = ring_allgather_bytes(payload_bytes, K)
        if self.swarm is None:  # hivemind: counted when the group is known (_finish_sync)
            self._count_bytes(sent)
        if payload_bytes:
            self.payload_by_fragment[fragment] = payload_bytes
        if self.link is not None:
            self._project_transfer(sync_seconds(self.link, payload_bytes, K, codec is not None), delay)

        cosine = None
        if unit_sum is not None and healthy > 1:
            cosine = (global_norm(unit_sum) ** 2 - healthy) / (healthy * (healthy - 1))
        alignment = self.probe.stats(global_params) if self.probe is not None else {}
        sync = InFlightSync(
            fragment=fragment,
            started_step=self.step,
            apply_step=self.step + delay,
            result=result,
            stats={
                # With R ranks per worker each rank's losses are shares of the worker's: counted once.
                "loss_sum_count": (
                    sum(self.round_losses),
                    len(self.round_losses) if self.topology.is_lead else 0,
                ),
                "norm_sum_count": (sum(norms), len(norms)),
                "pseudograd_cosine": cosine,
                "payload_bytes": payload_bytes,
                "bits_per_param": round(8 * payload_bytes / numel, 4) if payload_bytes else None,
                "alignment": alignment,
            },
        )
        self.round_losses = []
        self.in_flight.append(sync)
        return sync

    def _start_mean(
        self,
        fragment: int,
        delta_sum: list[torch.Tensor] | None,
        codec: PseudogradientCodec | None,
        messages: list[bytes],
        healthy: int,
        like: list[torch.Tensor],
    ) -> PendingMean:
        """Start the mean over all K replicas across workers (on each worker's lead rank), shared with the
        worker's other ranks when R > 1. Every process calls the same collectives in the same order."""
        K, topology = self.cfg.workers, self.topology
        if self.swarm is not None:
            return self.swarm.start_mean(fragment, self.step, delta_sum, codec, messages, healthy)
        pending = None
        if topology.sync is not None:
            if codec is None:
                pending = start_mean_uncompressed(topology.sync, delta_sum, healthy)
            else:
                pending = start_mean_compressed(topology.sync, codec, messages, K, like)
        if topology.worker is None:
            return pending
        return share_with_worker(topology.worker, pending, like)

    def _finish_sync(self, sync: InFlightSync) -> None:
        """Steps 4-5 of a sync: wait for the mean, outer step on the fragment, merge into the replicas."""
        t0 = time.perf_counter()
        mean = sync.result.wait()
        self.comm_wait_s += time.perf_counter() - t0
        self.in_flight.remove(sync)
        indices = self.fragments[sync.fragment]

        # 4. Outer Nesterov step on the fragment's fp32 global parameters (its own momentum buffers). Never
        #    with a non-finite value: without a finite mean the step is skipped.
        finite = mean.values is not None and math.isfinite(global_norm(mean.values))
        update_norm = None
        if finite:
            with record_function("muloco::outer_step"):
                update_norm = self.outer.step(mean.values, None if len(self.fragments) == 1 else indices)
        left_out = self.cfg.workers - mean.contributors if mean.left_out is None else mean.left_out
        if not finite:
            left_out = max(left_out, 1)
        self._count_bad_sync(left_out, f"sync of fragment {sync.fragment} at step {self.step}")
        self.fragment_syncs += 1
        self.outer_steps = self.fragment_syncs // len(self.fragments)
        swarm = {}
        if self.swarm is not None:
            # Each member uploads its payload to every other member of the group (a mesh all-gather).
            self._count_bytes((mean.group_size - 1) * sync.stats["payload_bytes"])
            swarm = {"group_size": mean.group_size}

        # 5. Merge: local <- alpha local + (1 - alpha) global (alpha = 0: restart from the global ones).
        alpha = self.cfg.sync.alpha
        for replica in self.replicas:
            if len(self.fragments) == 1 and alpha == 0.0:
                replica.load_global(self.outer.params)
            else:
                replica.merge_global(self.outer.params, indices, alpha)
        if alpha > 0:
            self.unsynced[sync.fragment] = True  # the replicas keep part of their own drift
        if self.probe is not None:
            self.probe.restart_from(self.outer.params)

        stats = sync.stats
        train_loss, pseudograd_norm = self._means_over_processes(
            stats["loss_sum_count"], stats["norm_sum_count"]
        )
        streaming = {}
        if self.cfg.sync.streaming:
            streaming = {"fragment": sync.fragment, "started_step": sync.started_step}
        self._log(
            "sync",
            train_loss=train_loss,
            pseudograd_norm=pseudograd_norm,
            pseudograd_cosine=stats["pseudograd_cosine"],
            outer_update_norm=update_norm,
            outer_step=self.outer_steps,
            replicas_left_out=left_out,
            payload_bytes=stats["payload_bytes"],
            bits_per_param=stats["bits_per_param"],
            **stats["alignment"],
            **streaming,
            **swarm,
        )
        if self.swarm is not None:
            self._catch_up_with_the_swarm(missed_group=mean.group_size == 1)

    def _count_bytes(self, sent: float) -> None:
        self.bytes_sent += sent
        self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, sent)

    def _count_bad_sync(self, left_out: int, what: str) -> None:
        """train.max_bad_syncs syncs in a row that left a replica out (non-finite) stop the run; the last
        checkpoint, written before them, stays as it is."""
        if left_out == 0:
            self.bad_syncs = 0
            return
        self.bad_syncs += 1
        log.warning("%s: %d of %d replicas left out (non-finite)", what, left_out, self.cfg.workers)
        limit = self.cfg.train.max_bad_syncs
        if self.bad_syncs >= limit:
            raise TrainingError(
                f"the run diverged: {self.bad_syncs} syncs in a row had non-finite replicas "
                f"(train.max_bad_syncs = {limit}); lower inner.lr / outer.lr or raise train.warmup_steps, "
                "then resume from the last checkpoint (checkpoint.resume=auto)"
            )

    def _next_sync_event(self) -> int:
        """The next step at which a sync starts or an in-flight one is applied."""
        return min([self.schedule.next_start(self.step), *(s.apply_step for s in self.in_flight)])

    def _dp_step(self) -> None:
        """One data-parallel step: gradients averaged over the K workers' batches, one optimizer step."""
        cfg, K = self.cfg, self.cfg.workers
        replica = self.replicas[0]
        set_lr_multiplier(replica.optimizer, self._lr_multiplier(self.step))
        loss_sum = 0.0
        t0 = time.perf_counter()
        with record_function("muloco::forward_backward"):
            for stream in self.dp_streams:
                batches = (stream.next_batch(self.seqs_per_micro) for _ in range(self.micro_batches))
                loss_sum += forward_backward(
                    replica.model, batches, 1.0 / (K * self.micro_batches), self.device, self.autocast
                )
        # Gradient all-reduce across processes (identity in one process); every process calls it each step.
        # One worker computes one of the K batches: its share of this process's forward/backward time.
        self.worker_compute_s += (time.perf_counter() - t0) / len(self.dp_streams)
        grads = [p.grad for p in replica.model.parameters()]
        t0 = time.perf_counter()
        self.backend.all_reduce_sum(grads).wait()
        self.comm_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        # Every process holds the same summed gradients, so all skip a non-finite step alike. Clipping
        # measures the norm anyway: one pass over the gradients, not two.
        if cfg.train.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(replica.model.parameters(), cfg.train.grad_clip).item()
        else:
            norm = global_norm(grads)
        finite = math.isfinite(norm)
        if finite:
            replica.optimizer.step()
        replica.optimizer.zero_grad(set_to_none=True)
        self._count_bad_sync(0 if finite else K, f"dp step {self.step + 1} (non-finite gradients: skipped)")
        self.worker_compute_s += time.perf_counter() - t0
        self.step += 1
        self.bytes_sent += ring_allreduce_bytes(4 * self.num_params, K)
        self.peak_bytes_per_sync = ring_allreduce_bytes(4 * self.num_params, K)
        if self.link is not None:
            self._project_transfer(allreduce_seconds(self.link, 4 * self.num_params, K), 0)
        if self.step % cfg.train.log_every == 0 or self.step == self.total_steps:
            count = len(self.dp_streams) * self.micro_batches
            (train_loss,) = self._means_over_processes((loss_sum, count))
            self._log("train", train_loss=train_loss)

    # -- helpers of the loop --------------------------------------------------------------------------
    def _project_transfer(self, seconds: float, overlap_steps: int) -> None:
        """WAN planner: a transfer of `seconds` on the configured link, hidden behind `overlap_steps` inner
        steps at the mean step time measured so far."""
        step_time = self.worker_compute_s / max(self.step, 1)
        self.projected_network_s += seconds
        self.projected_wait_s += max(0.0, seconds - overlap_steps * step_time)

    def _means_over_processes(self, *sums_and_counts: tuple[float, int]) -> list[float]:
        """Means of per-replica metrics over all K replicas, from each process's (sum, count) pairs. One
        collective with several processes: every rank calls it at the same point of the round."""
        values = torch.tensor([v for pair in sums_and_counts for v in pair], dtype=torch.float64)
        if self.backend.world_size > 1:
            values = self.backend.all_reduce_sum([values]).wait()[0]
        return [(values[i] / values[i + 1]).item() for i in range(0, len(values), 2)]

    def _stop_now(self) -> bool:
        """Stop inside a round, after the current inner step: single-process runs only. With several
        processes the ranks agree to stop at the end of the round (`_stop_requested`): agreeing after every
        inner step would cost a collective per step over the slow link DiLoCo is meant to spare."""
        return self.stop_signal is not None and self.backend.world_size == 1

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGINT/SIGTERM. With several processes this is a collective (every rank
        calls it once per round), so all ranks stop after the same round rather than one waiting forever."""
        if self.backend.world_size == 1:
            return self.stop_signal is not None
        flag = torch.tensor([0.0 if self.stop_signal is None else float(self.stop_signal)])
        flag = self.backend.all_reduce_sum([flag]).wait()[0]
        if flag.item() > 0 and self.stop_signal is None:
            self.stop_signal = signal.SIGTERM  # another rank was told to stop
        return flag.item() > 0

    def _lr_multiplier(self, step: int) -> float:
        t = self.cfg.train
        return lr_multiplier(step, self.total_steps, t.warmup_steps, t.lr_schedule, t.min_lr_ratio)

    @staticmethod
    def _next_multiple(value: int, every: int) -> float:
        return (value // every + 1) * every if every > 0 else math.inf

    def _activate(self, replica: Replica) -> None:
        if self.offload:
            replica.move_to(self.device)

    def _deactivate(self, replica: Replica) -> None:
        if self.offload:
            replica.move_to(torch.device("cpu"))

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Val loss of the global parameters: replica 0 holds them right after a plain DiLoCo merge (or is
        the dp model); with streaming its parameters are swapped for the global ones meanwhile."""
        replica = self.replicas[0]
        model = replica.model
        self._activate(replica)
        own = None
        if self.outer is not None and self.cfg.sync.streaming:
            own = [p.detach().clone() for p in model.parameters()]
            replica.load_global(self.outer.params)
        model.eval()
        losses = []
        with record_function("muloco::eval"):
            for x, y in self.val_set:
                with self.autocast():
                    losses.append(model(x.to(self.device), y.to(self.device)).item())
        model.train()
        if own is not None:
            for p, saved in zip(model.parameters(), own, strict=True):
                p.copy_(saved)
        self._deactivate(replica)
        val_loss = sum(losses) / len(losses)
        self.val_losses.append((self.step, val_loss))
        self._log("eval", val_loss=val_loss)

    def _elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def _log(self, kind: str, **values: Any) -> None:
        tokens = self.step * self.cfg.train.batch_tokens
        elapsed = self._elapsed()
        record = {"kind": kind, "step": self.step, "tokens": tokens, "time_s": round(elapsed, 3), **values}
        if kind != "eval":
            record["bytes_sent"] = self.bytes_sent
            record["tokens_per_s"] = round(tokens / elapsed, 1) if elapsed > 0 else None
            done = self.step / self.total_steps
            record["eta_s"] = round(elapsed * (1 - done) / done, 1) if done > 0 else None
        self.metrics.log(record)

    def _log_start(self) -> None:
        cfg = self.cfg
        replica = self.replicas[0]
        log.info(
            "run=%s dir=%s method=%s inner=%s workers=%d local_replicas=%d device=%s params=%d data=%s "
            "steps=%d sync_every=%d micro_batches=%d",
            cfg.run.name,
            self.run_dir,
            cfg.method,
            cfg.inner.optimizer,
            cfg.workers,
            len(self.local_indices),
            self.device,
            self.num_params,
            self.data.description,
            self.total_steps,
            cfg.sync.every,
            self.micro_batches,
        )
        describe = getattr(replica.optimizer, "describe", None)
        if describe is not None:
            log.info("inner optimizer routing:\n%s", describe())
        if cfg.simulation.offload and not self.offload:
            log.info(
                "simulation.offload has no effect on device=%s (replicas already live in host memory)",
                self.device,
            )

    def _save_checkpoint(self) -> None:
        state = {
            "fingerprint": self.cfg.fingerprint(),
            "local_indices": self.local_indices,
            "step": self.step,
            "outer_steps": self.outer_steps,
            "bytes_sent": self.bytes_sent,
            "elapsed_s": self._elapsed(),
            "val_losses": [list(v) for v in self.val_losses],
            "replicas": [r.state_dict() for r in self.replicas],
            "dp_streams": [s.state_dict() for s in self.dp_streams],
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
            "sync": {
                "fragment_syncs": self.fragment_syncs,
                "unsynced": self.unsynced,
                "in_flight": [s.state_dict() for s in self.in_flight],
                "round_losses": self.round_losses,
                "comm_wait_s": self.comm_wait_s,
                "bad_syncs": self.bad_syncs,
                "peak_bytes_per_sync": self.peak_bytes_per_sync,
                "payload_by_fragment": list(self.payload_by_fragment.items()),
                "worker_compute_s": self.worker_compute_s,
                "projected_network_s": self.projected_network_s,
                "projected_wait_s": self.projected_wait_s,
            },
        }
        with record_function("muloco::checkpoint"):
            path = save_checkpoint(state, self.checkpoint_dir, self.step, self.cfg.checkpoint.keep)
        log.info("checkpoint path=%s step=%d", path, self.step)

    def _projection(self) -> dict[str, Any]:
        """WAN planner figures for summary.json: one worker's measured compute plus the transfers on the
        configured link, with the overlapped part hidden (projected_wall_s) or not (..._no_overlap)."""
        if self.link is None:
            return {}
        compute = self.worker_compute_s
        wall = compute + self.projected_wait_s
        return {
            "projected_bandwidth_mbps": self.link.bandwidth_mbps,
            "projected_latency_ms": self.link.latency_ms,
            "projected_compute_s": round(compute, 3),
            "projected_network_s": round(self.projected_network_s, 3),
            "projected_wall_s": round(wall, 3),
            "projected_wall_s_no_overlap": round(compute + self.projected_network_s, 3),
            "projected_network_wait_fraction": round(self.projected_wait_s / wall, 4) if wall > 0 else None,
        }

    def _write_summary(self, status: str) -> dict[str, Any]:
        cfg, K = self.cfg, self.cfg.workers
        elapsed = self._elapsed()
        tokens = self.step * cfg.train.batch_tokens
        val = self.val_losses
        payload = sum(self.payload_by_fragment.values()) or None  # one replica's message, whole model
        summary = {
            "run_name": cfg.run.name,
            "method": cfg.method,
            "inner_optimizer": cfg.inner.optimizer,
            "workers": K,
            "ranks_per_worker": cfg.ranks_per_worker,
            "sync_every": cfg.sync.every if cfg.method == "diloco" else 1,
            "bits": 32 if cfg.compression.scheme == "none" else cfg.compression.bits,
            "compression": cfg.compression.scheme,
            "final_val_loss": val[-1][1] if val else None,
            "initial_val_loss": val[0][1] if val else None,
            "best_val_loss": min(v for _, v in val) if val else None,
            "tokens_seen": tokens,
            "inner_steps": self.step,
            "outer_steps": self.outer_steps,
            "fragments": cfg.sync.fragments,
            "overlap": cfg.sync.overlap,
            "alpha": cfg.sync.alpha,
            "fragment_syncs": self.fragment_syncs,
            "bytes_sent_per_worker": self.bytes_sent,
            "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "bytes_ddp_equivalent": self.step * ring_allreduce_bytes(4 * self.num_params, K),
            "payload_bytes_per_sync": payload,
            "effective_bits_per_param": round(8 * payload / self.num_params, 4) if payload else None,
            "error_feedback": cfg.compression.error_feedback and cfg.compression.scheme != "none",
            "wall_time_s": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            "train_tokens_per_s": round(tokens / self.train_time, 1)
            if getattr(self, "train_time", 0) > 0
            else None,
            "replica_compute_s": [round(r.compute_time_s, 3) for r in self.replicas],
            "worker_compute_s": round(self.worker_compute_s, 3),
            "comm_wait_s": round(self.comm_wait_s, 3),
            **self._projection(),
            "params": self.num_params,
            "device": str(self.device),
            "config_fingerprint": self.cfg.fingerprint(),
            "muloco_version": muloco.__version__,
            "status": status,
        }
        if self.is_main:
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    # -- signals: finish the current round/step, checkpoint, exit 130/143; a second Ctrl+C exits at once --
    def _install_signal_handlers(self) -> dict | None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum, frame):
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            when = "the current inner step" if self.backend.world_size == 1 else "this round"
            log.warning(
                "signal=%s received: stopping after %s, writing a checkpoint (Ctrl+C again: exit at once)",
                signal.Signals(signum).name,
                when,
            )

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(previous: dict | None) -> None:
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job from a validated config; returns the summary (also written to summary.json)."""
    return Trainer(cfg).run()
