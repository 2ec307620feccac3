"""Communication backends. A backend moves tensors and bytes between processes; it knows nothing about
optimizers.

- `base.py`: the `Backend` protocol and `Handle` (asynchronous operations), byte accounting helpers.
- `local.py`: one process hosting every replica (simulation); reductions across processes are identities.
- `torch_dist.py`: torch.distributed (gloo on CPU, nccl on CUDA), set up from the torchrun environment.
- `torchft_group.py`: a worker's membership in an elastic torchft run (quorums, collectives over them).
- `hivemind/`: a peer's membership of a swarm (matchmaking, exchange, state sharing, auth).
- `aggregate.py`: `sync.aggregate`, the rule every backend's sync combines the contributions with (mean and
  the robust ones); `digest.py`: `state_digest`, which a transferred state is checked against. Both are
  maths below the engine: the swarm combines and checks with them, and so does the engine's codec.
"""

import logging
import os

from muloco.comm.base import (
    Backend,
    CompletedHandle,
    Handle,
    ProcessMeans,
    means_over_processes,
    reduce_scatter_bytes,
    ring_allgather_bytes,
    ring_allreduce_bytes,
)
from muloco.comm.local import LocalBackend


def build_backend(cfg) -> Backend:
    """The backend named by `backend.kind`."""
    kind = cfg.backend.kind
    if kind == "local" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.getLogger("muloco").info(
            "WORLD_SIZE=%s is set (torchrun): using backend.kind=torch", os.environ["WORLD_SIZE"]
        )
        kind = "torch"
    if kind == "torchft" and cfg.ranks_per_worker > 1:
        # A worker of R ranks is a torch.distributed world of its own (its inner steps); its lead rank
        # joins the quorum. The other ranks wait in a broadcast while the lead tries a sync: every attempt's
        # quorum, collectives and heal transfer (each up to timeout_s), and a minute to spare.
        from muloco.comm.torch_dist import TorchDistBackend

        section = cfg.backend.torchft
        attempt_s = section.quorum_timeout_s + 2 * section.timeout_s
        timeout = attempt_s * (section.quorum_retries + 1) + 60.0
        return TorchDistBackend(timeout, cfg.backend.torch.dist_backend)
    if kind in ("local", "hivemind", "torchft"):
        # A hivemind peer or a torchft worker is a world of its own; its reducer joins the swarm / quorum.
        return LocalBackend()
    if kind == "torch":
        from muloco.comm.torch_dist import TorchDistBackend

        return TorchDistBackend(cfg.backend.torch.timeout_s, cfg.backend.torch.dist_backend)
    raise ValueError(f"backend.kind: unknown backend {cfg.backend.kind!r}")


__all__ = [
    "Backend",
    "CompletedHandle",
    "Handle",
    "LocalBackend",
    "build_backend",
    "ProcessMeans",
    "means_over_processes",
    "reduce_scatter_bytes",
    "ring_allgather_bytes",
    "ring_allreduce_bytes",
]
