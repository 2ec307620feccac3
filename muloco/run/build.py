"""Building a run's pieces from the config: the device, autocast, the counters, the replicas with their sync
engine (DiLoCo) or data-parallel step (dp), the alignment probe."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil

import torch
from torch import nn

from muloco.comm.topology import Topology
from muloco.config import Config
from muloco.data import ReplicaStream
from muloco.errors import ConfigError, UserError
from muloco.models import ParamRole, build_model, param_roles
from muloco.models.init import InitSource, initialize
from muloco.net.wan import Link
from muloco.optim import build_inner_optimizer
from muloco.run.alignment import AlignmentProbe, UnionStream
from muloco.run.ddp_hooks import CommHookDDP
from muloco.run.dp import DataParallel
from muloco.run.offload import ReplicaOffload
from muloco.run.replica import Replica
from muloco.sharding import shard_model, worker_mesh
from muloco.sync import Reducer, SyncEngine
from muloco.sync.counters import CommLedger, Progress, WanProjection


def resolve_device(name: str) -> torch.device:
    """The `device:` of the config; on CUDA, TF32 matmuls (fp32 accuracy is not what training needs)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was asked for but no CUDA device is available; use device=auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        # One GPU per local process (as torchrun's LOCAL_RANK and the nccl backend's device expect).
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


def autocast_factory(precision: str, device: torch.device):
    """train.precision: bf16 autocast (auto: on CUDA), else a no-op context."""
    if not (precision == "bf16" or (precision == "auto" and device.type == "cuda")):
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def cpu_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would use, or None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def maybe_compile(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    """model.compile: `nn.Module.compile()` in place, so parameter and state_dict names stay as they are.

    Every replica's module is a copy of one class: with torch's default inlining of nn.Modules their
    parameters are graph inputs, so the K replicas and every round reuse one compiled graph
    (tests/test_compile.py counts the graphs).
    """
    if not cfg.model.compile:
        return model
    if device.type == "cpu" and cpu_compiler() is None:
        raise UserError(
            "model.compile: torch.compile on the CPU needs a C++ compiler (g++ or clang++, or $CXX); "
            "install one or set model.compile=false"
        )
    model.compile()
    return model


def diloco_replicas(
    cfg: Config,
    template: nn.Module,
    indices: list[int],
    streams: list,
    device,
    topology: Topology,
    offload: ReplicaOffload | None,
) -> list[Replica]:
    """A DiLoCo worker's model copy, inner optimizer and stream per local replica (in host memory with
    simulation.offload); with workers of R ranks, this rank's share of each step (sharding=fsdp: and
    this rank's shard of the model, sharding.py)."""
    if topology.sharded:
        return [sharded_replica(cfg, template, indices, streams, device, topology)]
    worker, replicas = topology.worker, []
    # Distributed Muon: each matrix's momentum and Newton-Schulz on one rank of the worker.
    owners = worker.group if worker is not None and cfg.inner.distributed_muon else None
    for index, stream in zip(indices, streams, strict=True):
        model = copy.deepcopy(template).to(torch.device("cpu") if offload is not None else device)
        maybe_compile(model, cfg, device)
        optimizer = build_inner_optimizer(model, cfg.inner, process_group=owners)
        replica = Replica(index, model, optimizer, stream, device)
        replica.offload = offload
        replica.on_device = offload is None
        if worker is not None:
            replica.worker = worker
            replica.shard_index, replica.shard_count = topology.local_rank, worker.world_size
        replicas.append(replica)
    return replicas


def sharded_replica(
    cfg: Config, template: nn.Module, indices: list[int], streams: list, device, topology: Topology
) -> Replica:
    """sharding=fsdp: the worker's one replica, its model wrapped with FSDP2 over the worker's ranks. The
    template itself is sharded (no second whole copy): each rank keeps its rows of it."""
    if len(indices) != 1:
        raise UserError(
            f"sharding=fsdp runs one replica per worker, and each worker of {topology.ranks_per_worker} "
            f"ranks here would host {len(indices)}: launch workers x ranks_per_worker processes"
        )
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if topology.worker.dist_backend != wanted:  # FSDP2 runs its collectives on the parameters' device
        raise UserError(
            f"sharding=fsdp on device {device.type} needs backend.torch.dist_backend={wanted} (this run "
            f"has {topology.worker.dist_backend}); set it, or device={'cpu' if wanted == 'gloo' else 'cuda'}"
        )
    bf16 = device.type == "cuda" and cfg.train.precision in ("auto", "bf16")
    model = shard_model(template.to(device), worker_mesh(topology.worker, device), bf16)
    optimizer = build_inner_optimizer(model, cfg.inner, sharded=True)
    replica = Replica(indices[0], model, optimizer, streams[0], device)
    replica.shard_index, replica.shard_count = topology.local_rank, topology.ranks_per_worker
    return replica


def dp_replica(cfg: Config, template: nn.Module, index: int, stream, device) -> Replica:
    """dp: one model whose micro-batches are the K workers' batches."""
    model = maybe_compile(template.to(device), cfg, device)
    return Replica(index, model, build_inner_optimizer(model, cfg.inner), stream, device)


def check_comm_hook_world(cfg: Config, backend) -> None:
    """dp.comm_hook runs torch's DDP: one process per worker in a torch.distributed world."""
    if cfg.dp.comm_hook != "none" and (
        backend.world_size != cfg.workers or not torch.distributed.is_initialized()
    ):
        raise ConfigError(
            f"dp.comm_hook={cfg.dp.comm_hook} runs torch's DDP with one process per worker, but "
            f"{backend.world_size} process(es) run workers={cfg.workers}: launch {cfg.workers} processes "
            f"(muloco launch --nproc {cfg.workers}), or set dp.comm_hook=none"
        )


def uses_ddp(cfg: Config, backend) -> bool:
    """Whether method dp runs through torch's DistributedDataParallel: with a comm hook, and for fp32 over
    processes of one worker each, as users run DDP (its buckets' all-reduces overlap the backward). The
    simulation, several workers per process, or workers of several ranks keep the flat all-reduce after the
    backward, the reference DDP equals to float tolerance (tests/comm/test_torch_dist.py)."""
    if cfg.dp.comm_hook != "none":
        return True
    return (
        backend.world_size > 1
        and backend.world_size == cfg.workers
        and cfg.ranks_per_worker == 1
        and torch.distributed.is_initialized()
    )


def data_parallel(
    cfg: Config,
    replica: Replica,
    streams: list[ReplicaStream],
    backend,
    shape: tuple[int, int],
    progress: Progress,
    ledger: CommLedger,
    wan: WanProjection,
) -> DataParallel:
    """method: dp over the run's K workers; shape: (micro-batches, sequences per micro-batch)."""
    micro_batches, seqs_per_micro = shape
    ddp = CommHookDDP(replica.model, cfg.dp) if uses_ddp(cfg, backend) else None
    return DataParallel(
        replica,
        streams,
        backend,
        workers=cfg.workers,
        micro_batches=micro_batches,
        seqs_per_micro=seqs_per_micro,
        grad_clip=cfg.train.grad_clip,
        max_bad_syncs=cfg.train.max_bad_syncs,
        progress=progress,
        ledger=ledger,
        wan=wan,
        ddp=ddp,
    )


def alignment_probe(cfg: Config, template: nn.Module, train_data, device) -> AlignmentProbe:
    """diagnostics.alignment: a replica on the union of the K workers' batches (alignment.py)."""
    K = cfg.workers
    streams = [ReplicaStream(train_data, cfg.model.seq_len, r, K, cfg.run.seed) for r in range(K)]
    model = maybe_compile(copy.deepcopy(template).to(device), cfg, device)
    replica = Replica(-1, model, build_inner_optimizer(model, cfg.inner), UnionStream(streams), device)
    roles = param_roles(model)
    matrices = [i for i, (n, _) in enumerate(model.named_parameters()) if roles[n] == ParamRole.MATRIX]
    return AlignmentProbe(replica, matrices)


def sync_engine(
    cfg: Config,
    template: nn.Module,
    reducer: Reducer,
    replicas: list,
    device,
    *,
    progress: Progress,
    ledger: CommLedger,
    wan: WanProjection,
    shard_group=None,
) -> SyncEngine:
    """The sync engine of `muloco train` (outer.offload=cpu keeps the fp32 global copy in host memory)."""
    return SyncEngine(
        template,
        reducer,
        sync=cfg.sync,
        outer=cfg.outer,
        compression=cfg.compression,
        local_replicas=len(replicas),
        max_bad_syncs=cfg.train.max_bad_syncs,
        total_steps=cfg.total_steps,
        outer_device=torch.device("cpu") if cfg.outer.offload == "cpu" else device,
        progress=progress,
        ledger=ledger,
        wan=wan,
        shard_group=shard_group,
    )


def run_counters(cfg: Config, num_params: int) -> dict:
    """The run's counters (sync/counters.py), by component name: progress, the byte ledger and the WAN
    projection on backend.local's configured link (none without a bandwidth)."""
    progress = Progress()
    bandwidth = cfg.backend.local.bandwidth_mbps
    link = Link(bandwidth, cfg.backend.local.latency_ms) if bandwidth else None
    wan = WanProjection(link=link, progress=progress)
    return {"progress": progress, "ledger": CommLedger(num_params=num_params), "wan": wan}


def training_method(
    cfg: Config,
    template: nn.Module,
    streams: list[ReplicaStream],
    where: tuple,
    batch_shape: tuple[int, int],
    counters: dict,
) -> tuple[list[Replica], SyncEngine | None, DataParallel | None]:
    """This process's replicas and what keeps them in step: the sync engine (DiLoCo) or the data-parallel
    step (dp). where: (backend, topology, reducer, local replica indices, device, offload)."""
    backend, topology, reducer, local_indices, device, offload = where
    if cfg.method == "dp":
        replicas = [dp_replica(cfg, template, local_indices[0], streams[0], device)]
        return replicas, None, data_parallel(cfg, replicas[0], streams, backend, batch_shape, **counters)
    replicas = diloco_replicas(cfg, template, local_indices, streams, device, topology, offload)
    # Sharded: the engine holds this rank's rows of the wrapped model's parameters.
    initial = replicas[0].model if topology.sharded else template
    shards = topology.worker if topology.sharded else None
    return (
        replicas,
        sync_engine(cfg, initial, reducer, replicas, device, shard_group=shards, **counters),
        None,
    )


def initial_model(cfg: Config, vocab_size: int, backend) -> tuple[nn.Module, InitSource | None]:
    """The model every replica starts from: the seeded initialization, or the weights model.hf.pretrained /
    model.init_from name (models/init.py). With several processes rank 0's weights are also broadcast
    (every process must take part), so all replicas start identical."""
    torch.manual_seed(cfg.run.seed)
    template = build_model(cfg.model, vocab_size)
    init_source = initialize(template, cfg.model)
    backend.broadcast([p.data for p in template.parameters()], src=0).wait()
    return template, init_source
