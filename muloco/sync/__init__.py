"""The sync engine: from the replicas' inner steps to the next round (docs/design.md, "Layers").

- `engine.py`: `SyncEngine`: the round (`round`: apply what is due, start what is scheduled, follow a moved
  quorum), one sync in two halves (`start` -> `InFlightSync`, `finish` -> `SyncRecord`), error-feedback
  buffers; its docstring walks through a round. `engine_state.py`: its checkpoint state.
- `counters.py`: the run's counters the engine books into (`Progress`, `CommLedger`, `WanProjection`).
- `gather.py`: this process's part of a sync (`Gathered`: the replicas' pseudogradients, summed or encoded).
- `messages.py`: how each fragment travels (codecs, transport, the part owners' feedback), decided once.
- `outer.py`: the fp32 global copy and the outer Nesterov step (`nesterov_outer_step`, `OuterOptimizer`).
- `fragments.py`: Streaming DiLoCo's fragments (`assign_fragments`, the `Fragment` object) and their
  staggered `SyncSchedule`.
- `codec.py`: a replica's message (`PseudogradientCodec`: per-parameter compressors, encode, decode-mean).
- `reduce.py`: the `Reducer` protocol, `Contribution`, `Mean`, `PendingMean`, and `CollectiveReducer`
  (local / torch.distributed with the worker topology); the swarm's is `SwarmReducer` (swarm.py).
- `inflight.py`: `InFlightSync` (a sync between start and application, checkpointable), `SyncRecord` and
  `SumCount` (a sum over this process's replicas, averaged over the processes by the caller).
- `guard.py`: the non-finite guard (replicas left out of a sync; `train.max_bad_syncs`).
- `elastic.py`: `ElasticReducer`, the reducer over a torchft quorum (`muloco.comm.torchft_group`): a quorum
  per sync, retries, a rejoining worker's live heal (imports torchft lazily).
- `swarm.py`: `SwarmReducer`, the reducer over a hivemind swarm (`muloco.comm.hivemind.HivemindSwarm`):
  contributions, joining and catching up through the engine's `SharedState` (imports hivemind lazily);
  with `deadline.py`'s `RoundDeadline` (sync.deadline: adaptive) and `late_windows.py` a late window joins
  the next sync.
"""

from __future__ import annotations

from muloco.comm.aggregate import tolerated
from muloco.sync.engine import SyncEngine
from muloco.sync.gather import global_norm
from muloco.sync.inflight import InFlightSync, SumCount, SyncRecord
from muloco.sync.messages import build_codecs
from muloco.sync.reduce import CollectiveReducer, Contribution, Mean, PendingMean, Reducer


def build_reducer(cfg, topology) -> Reducer:
    """The reducer `backend.kind` names: a hivemind swarm, a torchft quorum, else collectives over the
    processes' topology."""
    if cfg.backend.kind == "hivemind":
        from muloco.sync.deadline import RoundDeadline
        from muloco.sync.swarm import SwarmReducer

        deadline = RoundDeadline(mads=cfg.sync.deadline_mads) if cfg.sync.deadline == "adaptive" else None
        tolerate = tolerated(cfg.sync.aggregate, cfg.sync.trim)
        return SwarmReducer(
            cfg.backend.hivemind, cfg.workers, tolerate, deadline, cfg.sync.every, cfg.total_steps
        )
    if cfg.backend.kind == "torchft":
        from muloco.sync.elastic import ElasticReducer

        return ElasticReducer(cfg.backend.torchft, cfg.workers, topology)
    return CollectiveReducer(topology, cfg.workers)


__all__ = [
    "CollectiveReducer",
    "Contribution",
    "InFlightSync",
    "Mean",
    "PendingMean",
    "Reducer",
    "SumCount",
    "SyncEngine",
    "SyncRecord",
    "build_codecs",
    "build_reducer",
    "global_norm",
]
