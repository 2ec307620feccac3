"""A run's trained weights: the global parameters of one of its checkpoints, by name.

What `muloco sample`, `muloco export`, `muloco eval` and `model.init_from` read. DiLoCo: the outer
optimizer's fp32 copy (what every worker starts each round from); dp: the one model. A source is a run
directory (its newest intact checkpoint, or the one of `step`) or one checkpoint: a `step_*.pt` file, or a
sharded checkpoint's `step_*` directory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from muloco.checkpoint.plain import checkpoint_path, checkpoint_step, find_resume_state, load_checkpoint
from muloco.checkpoint.plain import list_checkpoints as list_plain
from muloco.checkpoint.sharded import list_sharded, load_sharded, newest_intact, verify_digests
from muloco.errors import CheckpointError, UserError, one_line


@dataclass
class RunWeights:
    path: Path  # the checkpoint read
    step: int  # its inner step
    params: dict[str, torch.Tensor]  # the global parameters (dp: the model's state_dict) by name


def _weights_of(path: Path, state: dict) -> RunWeights:
    if "engine" in state:
        outer = state["engine"]["outer"]
        params = dict(zip(outer["names"], outer["params"], strict=True))
    else:
        params = dict(state["replicas"][0]["model"])
    return RunWeights(path, int(state["progress"]["steps"]), params)


def _read_sharded(path: Path) -> RunWeights:
    verify_digests(path)
    return _weights_of(path, load_sharded(path, "replica0", None))  # whole tensors, one process


def _steps_held(run_dir: Path) -> str:
    steps = [checkpoint_step(p) for p in list_plain(run_dir / "checkpoints")]
    steps += [int(p.name.split("_")[1]) for p in list_sharded(run_dir / "checkpoints" / "sharded")]
    return ", ".join(str(s) for s in sorted(steps)) or "none"


def read_run_weights(source: str | Path, step: int | None = None, field: str = "RUN_DIR") -> RunWeights:
    """The global parameters of `source` (a run directory or one checkpoint); a one-line UserError or
    CheckpointError naming `field` when there are none."""
    path = Path(source).expanduser()
    if path.is_file():
        return _weights_of(path, load_checkpoint(path))
    if (path / ".metadata").is_file():  # one sharded checkpoint
        return _read_sharded(path)
    if not (path / "config.yaml").is_file():
        raise UserError(
            f"{field}: {path} is neither a run directory (with config.yaml) nor a checkpoint; "
            "name a run directory such as runs/quickstart"
        )
    sharded_dir = path / "checkpoints" / "sharded"
    if step is not None:
        plain, sharded = checkpoint_path(path / "checkpoints", step), sharded_dir / f"step_{step:08d}"
        if plain.is_file():
            return _weights_of(plain, load_checkpoint(plain))
        if (sharded / ".metadata").is_file():
            return _read_sharded(sharded)
        raise UserError(
            f"--step {step}: {path} has no checkpoint of step {step} (it has: {_steps_held(path)})"
        )
    if list_sharded(sharded_dir):
        newest, problem = newest_intact(list_sharded(sharded_dir))
        if problem:
            raise CheckpointError(problem)
        return _read_sharded(sharded_dir / newest)
    found = find_resume_state("auto", path / "checkpoints")
    if found is None:
        raise UserError(
            f"{field}: {path} has no checkpoint yet; wait for one (checkpoint.every) or the run to end"
        )
    return _weights_of(*found)


def load_weights(model: nn.Module, weights: RunWeights) -> None:
    """Copy `weights` into `model`; a checkpoint of another model is a one-line CheckpointError."""
    try:
        with torch.no_grad():
            named = dict(model.named_parameters())
            if set(weights.params) == set(named):
                for name, value in weights.params.items():
                    if named[name].shape != value.shape:
                        raise ValueError(f"{name}: {tuple(value.shape)} for {tuple(named[name].shape)}")
                    named[name].copy_(value)
            else:  # dp's state_dict, which may hold buffers besides the parameters
                model.load_state_dict(weights.params)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint {weights.path} does not fit this model ({one_line(exc)[:300]}); "
            "was it written by a run of another model or vocabulary?"
        ) from None


def weights_digest(model: nn.Module) -> str:
    """sha256 of the model's parameters (names, shapes, dtypes and bytes), to tell sources apart."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        tensor = p.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:16]
