"""summary.json (docs/design.md's contract): the config's key figures, every component's summary fields, and
the run's throughput."""

from __future__ import annotations

import sys
from typing import Any

from muloco.comm import ring_allreduce_bytes
from muloco.config import Config
from muloco.sharding import local
from muloco.version import __version__


def config_figures(cfg: Config) -> dict[str, Any]:
    """What the config says about the run, in the summary's names."""
    compressed = cfg.compression.scheme != "none"
    return {
        "run_name": cfg.run.name,
        "method": cfg.method,
        "inner_optimizer": cfg.inner.optimizer,
        "workers": cfg.workers,
        "ranks_per_worker": cfg.ranks_per_worker,
        "sharding": cfg.sharding,
        "sync_every": cfg.sync.every if cfg.method == "diloco" else 1,
        "bits": cfg.compression.bits if compressed else 32,
        "compression": cfg.compression.scheme,
        "fragments": cfg.sync.fragments,
        "overlap": cfg.sync.overlap,
        "alpha": cfg.sync.alpha,
        "error_feedback": cfg.compression.error_feedback and compressed,
    }


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory (Linux and macOS report it in different units)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _bytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def rank_state_bytes(replicas: list, engine) -> dict[str, int]:
    """What this rank holds of the training state, in bytes (summary.json's state_bytes_rank0;
    docs/topology.md): its parameters, as many gradient bytes (each parameter's gradient is materialized
    in the step), the inner optimizer's state, and the engine's outer state (the fp32 global copy, the
    outer momentum, error-feedback buffers)."""
    params = sum(_bytes(r.model.parameters()) for r in replicas)
    optimizer = sum(r.optimizer.state_bytes() for r in replicas)
    outer = 0
    if engine is not None:
        outer = _bytes(engine.outer.params) + _bytes(engine.outer.momentum_buffers)
        outer += sum(_bytes(ef.buffers.values()) for ef in engine.error_feedback if ef is not None)
    return {"parameters": params, "gradients": params, "optimizer": optimizer, "outer": outer}


def build_summary(
    cfg: Config,
    components: dict[str, Any],
    replicas: list,
    *,
    num_params: int,
    device: str,
    elapsed_s: float,
    train_time_s: float,
    status: str,
    tokens: int | None = None,
) -> dict[str, Any]:
    """tokens: what the workers trained (default: every worker every step; pacing by speed: fewer)."""
    steps = components["progress"].steps
    tokens = steps * cfg.train.batch_tokens if tokens is None else tokens
    return {
        **config_figures(cfg),
        # sync.transport as resolved (auto -> all_gather | reduce_scatter; fp32 and dp: all_reduce)
        # sync.mode: async sends each window's message to the global parameters' holder alone
        "transport": "point_to_point"
        if "async" in components
        else getattr(components.get("engine"), "transport", "all_reduce"),
        **(dp_figures(components["dp"]) if "dp" in components else {}),
        "tokens_seen": tokens,
        **components["progress"].summary(),
        **components["ledger"].summary(),
        "bytes_ddp_equivalent": steps * ring_allreduce_bytes(4 * num_params, cfg.workers),
        "wall_time_s": round(elapsed_s, 3),
        "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        "train_tokens_per_s": round(tokens / train_time_s, 1) if train_time_s > 0 else None,
        "replica_compute_s": [round(r.compute_time_s, 3) for r in replicas],
        **(components["clock"].summary() if "clock" in components else {}),
        "state_bytes_rank0": rank_state_bytes(replicas, components.get("engine")),
        "peak_rss_bytes_rank0": peak_rss_bytes(),
        **components["wan"].summary(),
        **(components["membership"].summary() if "membership" in components else {}),  # torchft
        **getattr(components.get("engine"), "conclusion", {}),  # a swarm's final agreement
        "params": num_params,
        "device": device,
        "config_fingerprint": cfg.fingerprint(),
        "muloco_version": __version__,
        "status": status,
    }


def dp_figures(dp) -> dict[str, Any]:
    """How method dp moved its gradients: torch_ddp or all_reduce, and the bytes of each all-reduce of the
    last step (DDP's buckets as it laid them out; the flat all-reduce's one)."""
    return {"dp_gradients": dp.gradient_sync, "dp_bucket_bytes": dp.bucket_bytes}
