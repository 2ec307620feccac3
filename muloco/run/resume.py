"""What the ranks of a run agree on at start: the same config, and the checkpoint to resume from
(`checkpoint.resume`).

One process: the newest readable checkpoint (auto), a given file, or none (never). Several processes: a
process killed mid-run leaves the ranks at different newest checkpoints, so the ranks take the newest step
that every rank holds and can read, falling back step by step, and check that they all resume from the
same step. These are collectives: every rank calls `find_resume_checkpoint` once, at start.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from muloco.checkpoint.plain import checkpoint_step, find_resume_state, list_checkpoints, load_checkpoint
from muloco.checkpoint.sharded import find_sharded, list_sharded, load_sharded, read_info
from muloco.comm import Backend
from muloco.comm.topology import Topology
from muloco.config import Config
from muloco.errors import CheckpointError, UserError, one_line
from muloco.sharding import layout_free_fingerprint

log = logging.getLogger("muloco")

Found = tuple[Path, dict[str, Any]] | None


def check_same_config(backend: Backend, fingerprint: str) -> None:
    """A collective every rank calls first: ranks launched with different configs stop, all of them."""
    if backend.world_size == 1:
        return
    fingerprints = [p.decode() for p in backend.all_gather_bytes(fingerprint.encode()).wait()]
    if len(set(fingerprints)) > 1:
        backend.barrier()  # every rank saw the mismatch: none closes its connections while another reads
        raise UserError(
            f"the config differs across ranks (fingerprints by rank: {', '.join(fingerprints)}); "
            "start every rank with the same config file and KEY=VALUE overrides"
        )


def find_resume_checkpoint(
    backend: Backend, resume: str, directory: Path, fingerprint: str, local_indices: list[int]
) -> Found:
    """(path, state) to resume from, or None to start fresh; checks it belongs to this config and these
    replicas."""
    if backend.world_size > 1 and resume == "auto":
        found = _common_checkpoint(backend, directory)
    else:
        found = find_resume_state(resume, directory)
    if backend.world_size > 1:
        _agree_on_step(backend, found)
    if found is None:
        return None
    path, state = found
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written with a different config; resume with the same config, "
            "or pick a new run.name (or checkpoint.resume=never to start over: the earlier run is moved "
            "to run.output_dir/.replaced/)"
        )
    if state.get("local_indices") != local_indices:
        raise CheckpointError(
            f"checkpoint {path} holds replicas {state.get('local_indices')}, not {local_indices}"
        )
    return found


def _common_checkpoint(backend: Backend, directory: Path) -> Found:
    """The newest step every rank holds and can read (collectives: every rank calls them)."""
    mine = {checkpoint_step(p): p for p in list_checkpoints(directory)}
    lists = backend.all_gather_bytes(json.dumps(sorted(mine)).encode()).wait()
    common = set(mine)
    for other in lists:
        common &= set(json.loads(other))
    for step in sorted(common, reverse=True):
        try:
            found = (mine[step], load_checkpoint(mine[step]))
        except CheckpointError as exc:
            log.warning("skipping unreadable checkpoint path=%s reason=%s", mine[step], exc)
            found = None
        readable = backend.all_gather_bytes(b"1" if found else b"0").wait()
        if all(flag == b"1" for flag in readable):
            if step != max(mine):
                log.warning("resuming from step %d, the newest checkpoint every rank holds", step)
            return found
    if any(json.loads(other) for other in lists):
        raise CheckpointError(
            f"no checkpoint step is held and readable by every rank (under {directory}); set "
            "checkpoint.resume=never to start over"
        )
    return None


def _agree_on_step(backend: Backend, found: Found) -> None:
    """Every rank must resume from the same step (a collective: all ranks call it)."""
    step = str(found[1]["progress"]["steps"] if found else -1).encode()
    steps = [int(s) for s in backend.all_gather_bytes(step).wait()]
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"ranks found checkpoints of different steps to resume from ({steps}); give every rank the same "
            "checkpoint.resume step, or set checkpoint.resume=never"
        )


def load_components(components: dict[str, Any], state: dict[str, Any], path: Path) -> None:
    """Every component's state from the checkpoint; a state that does not fit (a model whose code or
    vocabulary changed while the config did not, e.g. model.factory or a model.hf config.json edited) is
    a CheckpointError, not a traceback."""
    try:
        for name, component in components.items():
            if name not in state and getattr(component, "added_later", False):
                continue  # a component newer than the checkpoint starts from its defaults
            component.load_state_dict(state[name])
    except (RuntimeError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {path} does not fit this run ({one_line(exc)}); did the model's code or the data "
            "change? Set checkpoint.resume=never or use another run.name"
        ) from None


def resume_run(
    cfg: Config,
    backend: Backend,
    topology: Topology,
    run_dir: Path,
    checkpoint_dir: Path,
    local_indices: list[int],
    replica_model,
) -> Found:
    """The checkpoint `checkpoint.resume` names for this run (this process's files under checkpoint_dir),
    plain or sharded, and this process's state in it; None to start fresh. A collective: every rank calls
    it once, at start."""
    check_layout_of_checkpoints(cfg.checkpoint.resume, run_dir / "checkpoints", topology.sharded)
    if topology.sharded:
        return _find_sharded(cfg, backend, topology, checkpoint_dir, local_indices, replica_model)
    args = (cfg.checkpoint.resume, checkpoint_dir, cfg.fingerprint(), local_indices)
    return find_resume_checkpoint(backend, *args)


def check_layout_of_checkpoints(resume: str, checkpoints: Path, sharded: bool) -> None:
    """checkpoint.resume=auto on a run directory whose checkpoints are of the other sharding: refuse
    rather than start over beside them (every rank sees the same files)."""
    if resume != "auto":
        return
    if sharded and list_checkpoints(checkpoints):
        other, found = "replicate", checkpoints
    elif not sharded and list_sharded(checkpoints / "sharded"):
        other, found = "fsdp", checkpoints / "sharded"
    else:
        return
    raise CheckpointError(
        f"{found} holds checkpoints of sharding={other}; resume with sharding={other}, or pick a new "
        "run.name (or checkpoint.resume=never)"
    )


def _find_sharded(
    cfg: Config, backend: Backend, topology: Topology, directory: Path, local_indices: list[int], model
) -> Found:
    """A sharded checkpoint (any ranks_per_worker) and this replica's state in it, laid out for this
    run's ranks. Its INFO is checked on every rank and the ranks agree before any collective read."""
    path, problem = None, ""
    try:
        path = find_sharded(cfg.checkpoint.resume, directory, backend)
        if path is not None and read_info(path)["layout_fingerprint"] != layout_free_fingerprint(cfg):
            problem = (
                f"checkpoint {path} was written with a different config; resume with the same config "
                "(ranks_per_worker may differ), or pick a new run.name (or checkpoint.resume=never)"
            )
    except CheckpointError as exc:
        problem = str(exc)
    problems = [p.decode() for p in backend.all_gather_bytes(problem.encode()).wait()]
    if any(problems):
        raise CheckpointError(next(p for p in problems if p))
    if path is None:
        return None
    mesh = next(p for p in model.parameters()).device_mesh
    state = load_sharded(path, f"replica{local_indices[0]}", mesh)
    # Every rank of the worker saved its RNG; a rank beyond the saved ranks (R grew) takes the lead's.
    by_rank = state["rng"]["by_rank"]
    state["rng"] = by_rank[min(topology.local_rank, len(by_rank) - 1)]
    return path, state
