"""Two-level topology: DiLoCo workers that span several processes (docs/topology.md).

The world's W processes form G = W / R workers of R ranks each (ranks g R .. g R + R - 1 are worker g).
Inside a worker the ranks split every inner step's micro-batches and all-reduce gradients over the fast
local link (the worker group); only each worker's first rank (its lead) takes part in the pseudogradient
sync across workers (the sync group) and then broadcasts the mean to its worker's other ranks. With R = 1
the sync group is the world and there is no worker group: the layout of docs/design.md.

Sharded workers (`sharding: fsdp`, muloco/sharding.py) hold 1/R of the model per rank, so every rank
syncs: rank j of each worker averages its shard with rank j of the other workers (R sync groups, each
sending 1/R of the bytes), and the worker group (also with R = 1) is the mesh FSDP2 shards over.
"""

from __future__ import annotations

from dataclasses import dataclass

from muloco.comm.base import Backend
from muloco.errors import UserError


@dataclass
class Topology:
    ranks_per_worker: int  # R
    num_workers: int  # G: worker groups (each hosts K / G replicas)
    worker_index: int  # g: this process's worker group
    local_rank: int  # j in [0, R): this process's rank inside its worker
    sync: Backend | None  # across the workers' lead ranks; None on the other ranks
    worker: Backend | None  # the R ranks of this worker; None when R = 1 (unless sharded)
    sharded: bool = False  # sharding=fsdp: every rank holds and syncs a shard (sync is never None)

    @property
    def is_lead(self) -> bool:
        return self.local_rank == 0


def build_topology(world: Backend, ranks_per_worker: int, sharded: bool = False) -> Topology:
    """Split the world into workers of `ranks_per_worker` ranks (a collective: every process calls it)."""
    R, W = ranks_per_worker, world.world_size
    if sharded:
        return _sharded_topology(world, R)
    if R == 1:
        return Topology(1, W, world.rank, 0, world, None)
    if W % R != 0:
        raise UserError(
            f"ranks_per_worker ({R}) must divide the number of processes ({W}); launch a multiple of {R}"
        )
    subgroup = getattr(world, "subgroup", None)
    if subgroup is None:
        raise UserError(
            f"ranks_per_worker ({R}) needs several processes: use backend.kind=torch and "
            f"`muloco launch --nproc <workers x {R}>`"
        )
    G = W // R
    worker = None
    for g in range(G):  # every process creates every group, in the same order (new_group is collective)
        group = subgroup(list(range(g * R, (g + 1) * R)))
        worker = group if group is not None else worker
    sync = subgroup([g * R for g in range(G)])
    return Topology(R, G, world.rank // R, world.rank % R, sync, worker)


def _sharded_topology(world: Backend, R: int) -> Topology:
    """Workers of R ranks that each hold a shard: R sync groups (rank j of every worker) and a worker
    group per worker, even of one rank (FSDP2's mesh)."""
    W = world.world_size
    subgroup = getattr(world, "subgroup", None)
    if subgroup is None:
        raise UserError("sharding=fsdp needs backend.kind=torch (`muloco launch --nproc <workers x R>`)")
    if W % R != 0:
        raise UserError(
            f"ranks_per_worker ({R}) must divide the number of processes ({W}); launch a multiple of {R}"
        )
    G = W // R
    worker = sync = None
    for g in range(G):  # new_group is a collective: every process creates every group, in the same order
        group = subgroup(list(range(g * R, (g + 1) * R)))
        worker = group if group is not None else worker
    for j in range(R):
        group = subgroup([g * R + j for g in range(G)])
        sync = group if group is not None else sync
    return Topology(R, G, world.rank // R, world.rank % R, sync, worker, sharded=True)
