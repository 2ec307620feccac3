"""A run's checkpoints: where they go, how they are written and which one a run resumes from. A checkpoint
is every component's state under its name (`{name: component.state_dict()}`), written atomically
(checkpoint/plain.py) or, for sharded workers, as one DCP directory of every rank's shards
(checkpoint/sharded.py, a collective of every rank); resume.py picks the one every rank agrees on."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.profiler import record_function

from muloco.checkpoint.plain import save_checkpoint
from muloco.checkpoint.sharded import save_sharded, with_ranks_rng
from muloco.comm import Backend
from muloco.comm.topology import Topology
from muloco.config import Config
from muloco.run.resume import load_components, resume_run
from muloco.sharding import layout_free_fingerprint

log = logging.getLogger("muloco")


class RunCheckpoints:
    def __init__(
        self, cfg: Config, run_dir: Path, backend: Backend, topology: Topology, local_indices: list[int]
    ) -> None:
        """This process's checkpoint directory: rank 0's files in checkpoints/, rank r's in
        checkpoints/rank<r>/; sharded workers share checkpoints/sharded/."""
        self.cfg, self.run_dir, self.backend, self.topology = cfg, run_dir, backend, topology
        self.local_indices = local_indices
        rank = backend.rank
        self.directory = run_dir / "checkpoints" / ("" if rank == 0 else f"rank{rank}")
        if topology.sharded:
            self.directory = run_dir / "checkpoints" / "sharded"

    def resume(self, components: dict[str, Any], model, init_source) -> Path | None:
        """Every component from the checkpoint that `checkpoint.resume` names (resume.py), if any: its
        path, or None to start fresh. A collective: every rank calls it once, at start."""
        where = (self.run_dir, self.directory, self.local_indices, model)
        found = resume_run(self.cfg, self.backend, self.topology, *where)
        if found is None:
            return None
        path, state = found
        if init_source is not None:
            init_source.check_resumed(state.get("init_digest"), path)
        load_components(components, state, path)
        return path

    def save(self, components: dict[str, Any], step: int, init_source) -> Path:
        """Every component's state under its name, written atomically."""
        state = {"fingerprint": self.cfg.fingerprint(), "local_indices": self.local_indices}
        if init_source is not None:
            state["init_digest"] = init_source.digest
        state.update({name: component.state_dict() for name, component in components.items()})
        keep = self.cfg.checkpoint.keep
        with record_function("muloco::checkpoint"):
            if self.topology.sharded:
                path = self._save_sharded(state, step, keep)
            else:
                path = save_checkpoint(state, self.directory, step, keep)
        log.info("checkpoint path=%s step=%d", path, step)
        return path

    def _save_sharded(self, state: dict[str, Any], step: int, keep: int) -> Path:
        """A collective of every rank (checkpoint/sharded.py)."""
        info = {"layout_fingerprint": layout_free_fingerprint(self.cfg), "workers": self.cfg.workers}
        prefix, topology = f"replica{self.local_indices[0]}", self.topology
        state, lead = with_ranks_rng(state, topology.worker), topology.is_lead
        return save_sharded(state, self.directory, step, keep, self.backend, prefix, lead, info)
