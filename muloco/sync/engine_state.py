"""The sync engine's state beyond one round. Its checkpoint: the outer optimizer (global parameters,
momentum), every local replica's error feedback and part owner's feedback, the syncs in flight (their
means), and which fragments hold unsynced steps. A sharded worker's (sharding=fsdp) tensors are DTensors
laid out like the parameter, so that a sharded checkpoint (checkpoint/sharded.py) can resume with another
R. And the shared state a torchft heal or a swarm joiner's catch-up hands over: the consensus's global
parameters, momentum and progress, never a worker's own error feedback or eager outer state."""

from __future__ import annotations

from typing import Any

import torch

from muloco.sharding import as_shard_of, local
from muloco.sync.inflight import InFlightSync


def engine_state(engine) -> dict[str, Any]:
    state = {
        "outer": engine.outer.state_dict(),
        "error_feedback": [ef.state_dict() if ef is not None else None for ef in engine.error_feedback],
        "owner_error_feedback": [ef.state_dict() if ef is not None else None for ef in engine.owner_feedback],
        "in_flight": [s.state_dict() for s in engine.in_flight],
        "unsynced": [f.unsynced for f in engine.fragments],
        **({"eager": engine.eager.state_dict()} if engine.eager is not None else {}),
    }
    if engine.sharded_like is not None:
        _as_shards(engine, state)
    return state


def _as_shards(engine, state: dict[str, Any]) -> None:
    like, index = engine.sharded_like, {name: i for i, name in enumerate(engine.outer.names)}
    outer = state["outer"] = dict(state["outer"])
    for key in ("params", "momentum_buffers"):
        outer[key] = [as_shard_of(t, p) for t, p in zip(outer[key], like, strict=True)]
    for ef in state["error_feedback"]:
        if ef is not None:
            ef["buffers"] = {n: as_shard_of(t, like[index[n]]) for n, t in ef["buffers"].items()}
    for sync in state["in_flight"]:
        values = sync["mean"]["values"]
        if values is not None:
            shards = [like[i] for i in engine.fragments[sync["fragment"]].indices]
            sync["mean"]["values"] = [as_shard_of(t, p) for t, p in zip(values, shards, strict=True)]


def load_engine_state(engine, state: dict[str, Any]) -> None:
    state = _local_rows(state)  # a sharded checkpoint's DTensors: this rank's rows
    engine.outer.load_state_dict(state["outer"])
    owner = state.get("owner_error_feedback", [None] * len(engine.owner_feedback))  # none before transports
    for buffers, states in ((engine.error_feedback, state["error_feedback"]), (engine.owner_feedback, owner)):
        for ef, ef_state in zip(buffers, states, strict=True):
            if ef is not None and ef_state is not None:
                ef.load_state_dict(ef_state)
    engine.in_flight = [InFlightSync.from_state_dict(s) for s in state["in_flight"]]
    for sync in engine.in_flight:  # a checkpoint loads on the CPU: a mean goes where the outer step is
        mean = sync.result.wait()
        if mean.values is not None:
            mean.values = [v.to(engine.outer.device) for v in mean.values]
    for fragment, unsynced in zip(engine.fragments, state["unsynced"], strict=True):
        fragment.unsynced = unsynced
    if engine.eager is not None:
        engine.eager.load_state_dict(state["eager"])


def export_shared_state(engine) -> tuple[list[torch.Tensor], dict[str, int]]:
    """What a healthy worker hands a healing or joining one: the outer parameters and momentum, and the
    progress."""
    p = engine.progress
    meta = {"step": p.steps, "outer_steps": p.outer_steps, "fragment_syncs": p.fragment_syncs}
    return [*engine.outer.params, *engine.outer.momentum_buffers], meta


def adopt_shared_state(engine, tensors: list[torch.Tensor], meta: dict[str, int], replicas: list) -> None:
    """A healing or joining worker takes export_shared_state's tensors and progress: its replicas restart
    from the adopted global parameters with no steps of their own, its eager outer state from the
    consensus."""
    n = len(engine.outer.params)
    engine.outer.load_state_dict(
        {"names": engine.outer.names, "params": tensors[:n], "momentum_buffers": tensors[n:]}
    )
    p = engine.progress
    p.steps, p.outer_steps, p.fragment_syncs = meta["step"], meta["outer_steps"], meta["fragment_syncs"]
    p.round_losses = []
    for replica in replicas:
        replica.load_global(engine.outer.params)
        replica.inner_steps = p.steps
    if engine.eager is not None:
        engine.eager.restart_from_consensus()
    for fragment in engine.fragments:
        fragment.unsynced = False
    # Error-feedback residuals were left by messages encoded from the old global parameters.
    for ef in (*engine.error_feedback, *engine.owner_feedback):
        if ef is not None:
            ef.reset()


def _local_rows(value: Any) -> Any:
    """`value` with every DTensor replaced by this rank's rows (sharding.local)."""
    if isinstance(value, dict):
        return {k: _local_rows(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local_rows(v) for v in value]
    return local(value) if isinstance(value, torch.Tensor) else value
