"""`Config`: the whole schema, its cross-section checks, derived quantities and fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from muloco.config.exchange import CompressionConfig, SyncConfig
from muloco.config.optimizers import DpConfig, InnerConfig, OuterConfig
from muloco.config.runtime import (
    BackendConfig,
    CheckpointConfig,
    DiagnosticsConfig,
    LoggingConfig,
    SimulationConfig,
)
from muloco.config.sections import (
    DataConfig,
    ModelConfig,
    RunConfig,
    Section,
    TrainConfig,
)

# What the fingerprint leaves out: where the replicas run and what is logged when (a run may resume on
# another layout or with other logging). model.compile: where the maths runs, not what it is.
NOT_FINGERPRINTED_SECTIONS = (
    "run",
    "logging",
    "checkpoint",
    "backend",
    "simulation",
    "device",
    "diagnostics",
)
NOT_FINGERPRINTED_KEYS = (
    "train.threads",
    "train.log_every",
    "train.eval_every",
    "train.eval_tokens",
    "train.max_bad_syncs",
    "model.compile",
    "dp.bucket_mb",
)


def fingerprinted(key: str) -> bool:
    """Whether a dotted key (`inner.lr`) is part of the config's fingerprint, i.e. changes the maths."""
    parts = key.split(".")
    return parts[0] not in NOT_FINGERPRINTED_SECTIONS and ".".join(parts[:2]) not in NOT_FINGERPRINTED_KEYS


# sync.deadline: adaptive, where it cannot be built (docs/heterogeneous.md, "A deadline for stragglers").
DEADLINE_REFUSALS = {
    "torch": "sync.deadline=adaptive goes on without a late worker, but a torch.distributed group is fixed: "
    "every sync is a collective of all its ranks. Use backend.kind=hivemind, or sync.pacing=by_speed for "
    "workers that are slower for good",
    "local": "sync.deadline=adaptive bounds the wait for late processes; a simulation's workers share one "
    "clock and are never late: use sync.deadline=off (train.speed emulates slower workers)",
    "torchft": "sync.deadline=adaptive needs the workers to decide when a sync stops waiting, but torchft's "
    "lighthouse decides when a quorum forms (join_timeout_s, fixed at its start) and a slow worker's torchft "
    "thread heartbeats on, so the quorum waits that long for it. Use backend.kind=hivemind, or set "
    "backend.torchft.join_timeout_s",
}


class Config(Section):
    """A whole run. Sections as in docs/design.md."""

    run: RunConfig = Field(default_factory=RunConfig)
    method: Literal["diloco", "dp"] = Field(
        "diloco", description="diloco (MuLoCo = diloco + muon) | dp (data-parallel baseline)."
    )
    workers: int = Field(1, gt=0, description="K: total replicas in the run.")
    ranks_per_worker: int = Field(
        1,
        gt=0,
        description="R: processes per DiLoCo worker (docs/topology.md). They split each inner step's "
        "micro-batches and reduce gradients every step; with sharding=replicate only the worker's first "
        "rank syncs pseudogradients with the other workers (fsdp: every rank, its shard). Launch K/k x R "
        "processes.",
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        "replicate",
        description="How a worker's R ranks hold its model (docs/topology.md). replicate: every rank holds "
        "all parameters, gradients and optimizer state; fsdp: FSDP2 (fully_shard per block and at the "
        "root) shards parameters, gradients, inner and outer optimizer state 1/R per rank, every rank "
        "syncs its shard with the same rank of the other workers, checkpoints are sharded "
        "(torch.distributed.checkpoint). fsdp needs backend.kind=torch.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present, else CPU.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    dp: DpConfig = Field(default_factory=DpConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        seq_len, workers = self.model.seq_len, self.workers
        unit = workers * seq_len
        if self.train.batch_tokens % unit != 0:
            nearest = max(unit, round(self.train.batch_tokens / unit) * unit)
            raise ValueError(
                f"train.batch_tokens ({self.train.batch_tokens}) must be a multiple of workers x "
                f"model.seq_len ({workers} x {seq_len} = {unit}); use e.g. {nearest}"
            )
        micro = self.train.micro_batch_tokens
        per_worker = self.train.batch_tokens // workers
        if micro is not None and (micro % seq_len != 0 or per_worker % micro != 0):
            raise ValueError(
                f"train.micro_batch_tokens ({micro}) must be a multiple of model.seq_len ({seq_len}) that "
                f"divides a worker's batch ({per_worker} tokens)"
            )
        if self.train.total_tokens < self.train.batch_tokens:
            raise ValueError(
                f"train.total_tokens ({self.train.total_tokens}) is smaller than one step "
                f"(train.batch_tokens = {self.train.batch_tokens}); raise it"
            )
        if self.ranks_per_worker > 1:
            if self.method == "dp":
                raise ValueError(
                    "ranks_per_worker applies to method: diloco (with method: dp every process is a data-"
                    "parallel rank already); set ranks_per_worker=1"
                )
            micro = self.train.micro_batch_tokens or self.worker_batch_tokens
            if (self.worker_batch_tokens // micro) % self.ranks_per_worker != 0:
                raise ValueError(
                    f"ranks_per_worker ({self.ranks_per_worker}) must divide a worker's micro-batches per "
                    f"step ({self.worker_batch_tokens // micro}); set train.micro_batch_tokens to fit"
                )
        if self.sharding == "fsdp":
            self._check_fsdp()
        self._check_speed()
        if self.sync.deadline == "adaptive" and self.backend.kind != "hivemind":
            raise ValueError(DEADLINE_REFUSALS.get(self.backend.kind, DEADLINE_REFUSALS["torch"]))
        if self.simulation.batched is True and (self.simulation.offload or self.ranks_per_worker > 1):
            raise ValueError(
                "simulation.batched=true keeps every replica of a process on the device and steps them "
                "together; it cannot run with simulation.offload=true or ranks_per_worker > 1: set "
                "simulation.batched=auto (or false)"
            )
        if self.backend.kind == "hivemind" and (self.method == "dp" or self.ranks_per_worker > 1):
            raise ValueError(
                "backend.kind=hivemind runs method: diloco with one process per worker (ranks_per_worker=1); "
                "use backend.kind=torch for method: dp or workers of several ranks"
            )
        if self.backend.kind == "torchft":
            self._check_torchft()
        if self.method == "diloco" and self.sync.aggregate == "trimmed_mean":
            self._check_trim()
        if (
            self.compression.scheme == "topk"
            and self.compression.topk_chunk
            and (self.sync.transport == "reduce_scatter")
        ):
            # A part owner's mean of K sparse parts keeps up to K x the entries, and re-cutting it to the
            # chunk's k drops what the senders kept: the all-gather sends the parts as they are.
            raise ValueError(
                "compression.topk_chunk (sparse parts) is all-gathered: a part owner's mean of K sparse "
                "parts is up to K x denser; set sync.transport=all_gather (or auto)"
            )
        if self.backend.kind == "hivemind" and self.sync.transport == "reduce_scatter":
            raise ValueError(
                "sync.transport=reduce_scatter needs a fixed set of workers (backend.kind local or torch); a "
                "hivemind swarm's groups change every sync, so its peers all-gather (docs/backends.md): set "
                "sync.transport=auto or all_gather"
            )
        if self.sync.overlap >= self.sync.every and self.backend.kind == "hivemind":
            # A swarm's catch-up hands a peer's state over at any time, and with a whole window
            # overlapped a sync is always in flight (docs/streaming.md).
            raise ValueError(
                f"sync.overlap={self.sync.overlap} (a whole window, H = {self.sync.every}) keeps a sync in "
                "flight at all times, which backend.kind=hivemind's catch-up does not carry yet; use "
                f"backend.kind local, torch or torchft, or sync.overlap < {self.sync.every}"
            )
        if self.sync.eager and (self.backend.kind == "hivemind" or self.sharding == "fsdp"):
            where = f"backend.kind={self.backend.kind}" if self.sharding != "fsdp" else "sharding=fsdp"
            raise ValueError(
                f"sync.eager keeps each worker's own outer parameters, which {where} does not hand over or "
                "shard yet; use backend.kind local, torch or torchft with sharding=replicate, or "
                "sync.eager=false"
            )
        if self.method == "dp" and self.sync.streaming:
            raise ValueError(
                "sync.fragments/overlap/alpha (Streaming DiLoCo) apply to method: diloco; with method: dp "
                "keep sync.fragments=1, sync.overlap=0, sync.alpha=0"
            )
        if self.dp.comm_hook != "none":
            self._check_comm_hook()
        if self.method == "dp" and self.compression.scheme != "none":
            raise ValueError(
                "compression applies to pseudogradients (method: diloco); with method: dp set "
                "compression.scheme=none"
            )
        if self.diagnostics.alignment and (
            self.method == "dp"
            or self.backend.kind != "local"
            or self.sync.streaming
            or self.sync.mode == "async"
        ):
            raise ValueError(
                "diagnostics.alignment needs method: diloco on backend.kind=local, synchronous, without "
                "streaming (sync.mode=sync, sync.fragments=1, sync.overlap=0, sync.alpha=0); set "
                "diagnostics.alignment=false"
            )
        if self.data.source == "tokens" and self.data.path is None:
            raise ValueError(
                "data.source: tokens needs data.path (a directory with train.bin, val.bin and meta.json)"
            )
        if self.data.source == "text" and self.data.path is None:
            raise ValueError("data.source: text needs data.path (files, a directory or a glob)")
        return self

    def _check_speed(self) -> None:
        speed = self.train.speed
        if isinstance(speed, list) and len(speed) != self.workers:
            raise ValueError(
                f"train.speed lists {len(speed)} speeds for {self.workers} workers: give one per worker "
                "(index r: worker r) or a single value"
            )
        measured = self.sync.pacing == "by_speed" and self.sync.pacing_speeds == "measured"
        if measured and self.backend.kind in ("hivemind", "torchft"):
            raise ValueError(
                f"sync.pacing_speeds=measured exchanges step times over all the workers, which "
                f"backend.kind={self.backend.kind} has no collective for: set sync.pacing_speeds=declared "
                "and each worker's speed in train.speed"
            )
        if self.sync.mode == "async":
            self._check_async()
        if self.method == "dp" and self.worker_speeds != [1.0] * self.workers:
            raise ValueError("train.speed emulates slower DiLoCo workers; with method: dp leave it at 1.0")

    def _check_async(self) -> None:
        """Asynchronous outer updates: DiLoCo in a simulation, or over torch.distributed with a parameter
        owner on rank 0 (run/async_processes.py), one worker a process; checkpoints there only at the end
        and on a signal, when every window has arrived."""
        if self.backend.kind in ("hivemind", "torchft"):
            # docs/heterogeneous.md: arrivals are applied one at a time to one copy of the global parameters
            raise ValueError(
                f"sync.mode=async applies each arrival to one copy of the global parameters, which "
                f"backend.kind={self.backend.kind} does not have (each worker holds its own and changes it "
                "only in a sync): use backend.kind=torch (a parameter owner on rank 0), or sync.mode=sync "
                "with sync.pacing=by_speed or sync.deadline=adaptive"
            )
        if self.method == "dp":
            raise ValueError("sync.mode=async runs DiLoCo: with method=dp use sync.mode=sync")
        if self.backend.kind != "torch":
            return
        if self.ranks_per_worker != 1 or self.checkpoint.every != 0:
            raise ValueError(
                "sync.mode=async over backend.kind=torch runs one worker a process and writes its checkpoint "
                "at the end and on a signal: set ranks_per_worker=1 and checkpoint.every=0"
            )
        if self.sync.pacing == "by_speed" and self.sync.pacing_speeds == "measured":
            raise ValueError(
                "sync.pacing_speeds=measured exchanges step times at each round's barrier, which "
                "sync.mode=async has none of: set sync.pacing_speeds=declared and train.speed"
            )

    @property
    def worker_speeds(self) -> list[float]:
        """train.speed, one per worker."""
        speed = self.train.speed
        return [float(v) for v in speed] if isinstance(speed, list) else [float(speed)] * self.workers

    def _check_comm_hook(self) -> None:
        """torch's DDP hooks compress dp's gradients (the world they need is checked at start: run/build.py;
        hivemind and torchft run no method dp)."""
        hook = self.dp.comm_hook
        if self.method != "dp":
            raise ValueError(
                f"dp.comm_hook={hook} compresses method: dp's gradients; DiLoCo compresses its "
                "pseudogradients with compression.scheme: set dp.comm_hook=none (or method: dp)"
            )

    def _check_trim(self) -> None:
        """trimmed_mean drops sync.trim contributions at each end and must keep one: 2 x trim + 1 of them
        (comm/aggregate.py's robust_minimum). With fewer it trims less, down to the plain mean, and a run
        configured to tolerate bad members would silently not."""
        trim, need = self.sync.trim, 2 * self.sync.trim + 1
        group, source = self.workers, f"workers={self.workers}"
        target = self.backend.hivemind.target_group_size if self.backend.kind == "hivemind" else None
        if target is not None and target < group:
            group, source = target, f"backend.hivemind.target_group_size={target}"
        if group < need:
            raise ValueError(
                f"sync.aggregate=trimmed_mean with sync.trim={trim} needs {need} contributions to drop "
                f"{trim} at each end and keep one, but {source} gives at most {group}: it would trim less, "
                f"down to the plain mean; raise it to {need}, lower sync.trim, or use sync.aggregate=mean"
            )

    def _check_fsdp(self) -> None:
        """What a sharded worker can run (muloco/sharding.py)."""
        unsupported = [
            (self.method == "dp", "method: dp (set method: diloco)"),
            (self.backend.kind != "torch", f"backend.kind={self.backend.kind} (use backend.kind=torch)"),
            (self.simulation.offload, "simulation.offload=true (set it false)"),
            (self.model.compile, "model.compile=true (set it false)"),
            (self.inner.optimizer == "torch_muon", "inner.optimizer=torch_muon (use muon)"),
            (
                self.inner.optimizer not in ("muon", "adamw", "sgd", "torch_muon"),
                f"inner.optimizer={self.inner.optimizer} (each rank would step its shard of a matrix as if "
                "it were the whole: exact only for elementwise rules; use muon, adamw or sgd)",
            ),
            (self.sync.aggregate != "mean", f"sync.aggregate={self.sync.aggregate} (use mean)"),
            (self.diagnostics.alignment, "diagnostics.alignment=true (set it false)"),
            (self.outer.offload == "cpu", "outer.offload=cpu (set outer.offload=none)"),
            (
                self.sync.transport == "reduce_scatter",
                "sync.transport=reduce_scatter (its owners' buffers are per rank; use auto or all_gather)",
            ),
        ]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"sharding=fsdp does not run with {what}")

    def _check_torchft(self) -> None:
        """What an elastic torchft worker can run (muloco/sync/elastic.py)."""
        if self.method == "dp":
            raise ValueError(
                "backend.kind=torchft runs method: diloco; use backend.kind=torch for method: dp"
            )
        if self.sync.transport == "reduce_scatter":
            raise ValueError(
                "sync.transport=reduce_scatter needs a fixed set of workers; a torchft quorum changes when a "
                "worker dies or rejoins, so its workers all-gather: set sync.transport=auto or all_gather"
            )
        section = self.backend.torchft
        waiting = section.wait_for_workers
        if waiting is not None and waiting > self.workers:
            raise ValueError(
                f"backend.torchft.wait_for_workers ({waiting}) must be <= workers ({self.workers})"
            )
        if section.min_replicas > self.workers:
            raise ValueError(
                f"backend.torchft.min_replicas ({section.min_replicas}) must be <= workers ({self.workers})"
            )

    # -- derived quantities --------------------------------------------------------------------------
    @property
    def worker_batch_tokens(self) -> int:
        return self.train.batch_tokens // self.workers

    @property
    def total_steps(self) -> int:
        """Inner steps in the run (every worker takes each step)."""
        return self.train.total_tokens // self.train.batch_tokens

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(
        self, exclude: tuple[str, ...] = NOT_FINGERPRINTED_SECTIONS, with_layout: bool = True
    ) -> str:
        """Hash of the settings that change the maths, to tell checkpoints and ranks apart. Where the
        replicas run (backend, simulation, device, train.threads) and what is logged when are left out:
        a run may resume on another layout or with other logging."""
        data = {k: v for k, v in self.to_dict().items() if k not in exclude}
        for key in NOT_FINGERPRINTED_KEYS:
            section, name = key.split(".")
            data[section].pop(name, None)
        # Keys added after checkpoints existed count only when set, so older checkpoints still resume.
        model = data["model"]
        for key, default in (
            ("qkv", "fused"),
            ("factory", None),
            ("kwargs", {}),
            ("hf", None),
            ("init_from", None),
        ):
            if model.get(key) == default:
                del model[key]
        if data["train"]["lr_schedule"] != "wsd":
            del data["train"]["decay_fraction"]  # added after checkpoints existed; acts only with wsd
        if data["dp"]["comm_hook"] == "none":
            del data["dp"]  # added after checkpoints existed; its other keys act only with a hook
        if data.get("sharding") == "replicate":
            del data["sharding"]  # added after checkpoints existed
        if not data["sync"]["eager"]:
            del data["sync"]["eager"]  # added after checkpoints existed
        if data["compression"].get("topk_chunk") is None:
            data["compression"].pop("topk_chunk", None)  # added after checkpoints existed
        # Added after checkpoints existed: count only when set.
        if data["train"].get("speed") == 1.0:
            del data["train"]["speed"]
        paced = (("pacing", "fixed"), ("pacing_speeds", "measured"), ("pacing_tolerance", 0.05))
        later = (("weight_by_tokens", False), ("mode", "sync"), ("momentum_every", None), ("deadline", "off"))
        later += (("deadline_mads", 3.0),)
        for key, default in (*paced, *later):
            if data["sync"].get(key) == default:
                del data["sync"][key]
        if not with_layout:  # a sharded checkpoint resumes with any ranks_per_worker (checkpoint/sharded.py)
            data.pop("ranks_per_worker", None)
            data.pop("sharding", None)
        if data["data"].get("dtype") is None:
            data["data"]["dtype"] = "uint16"  # the default before meta.json existed
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
