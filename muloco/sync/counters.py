"""A run's counters as components: each owns its state (checkpointed) and its summary.json fields. The
engine books steps, syncs and bytes into them; the run (muloco/run/) and `muloco.DiLoCo` read them.

A checkpoint is `{name: component.state_dict()}` (run/checkpointing.py), so a new counter is one new dataclass
field: it is saved, restored and, when its component lists it, summarised without further edits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from muloco.errors import CheckpointError
from muloco.net.wan import Link


class Component:
    """Dataclass fields are the state; a field with metadata {"state": False} is wiring, not state."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in _state_fields(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A field marked {"optional": True} was added after checkpoints existed: absent, it keeps its default.
        missing = [
            f.name for f in _state_fields(self) if f.name not in state and not f.metadata.get("optional")
        ]
        if missing:
            raise CheckpointError(
                f"checkpoint lacks {type(self).__name__} fields {missing}; it was written by another muloco "
                "version: resume with that version, or set checkpoint.resume=never"
            )
        for f in _state_fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])

    def summary(self) -> dict[str, Any]:
        return {}


def wiring(default: Any = None) -> Any:
    """A component's field that is wiring (what it works on), not state: left out of its checkpoint."""
    return field(default=default, metadata={"state": False})


def _state_fields(component: Component) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(component) if f.metadata.get("state", True)]


@dataclass
class Progress(Component):
    """Where the run is: inner steps every replica took, outer steps and fragment syncs applied, syncs in a
    row with a non-finite replica, losses, clocks."""

    steps: int = 0  # inner steps taken by every replica
    outer_steps: int = 0  # = fragment_syncs // P
    fragment_syncs: int = 0
    bad_syncs: int = 0  # syncs (dp: steps) in a row that left a non-finite replica out
    # Contributions left out of means for other reasons, by kind (a swarm's: other_step, download, ...).
    excluded: dict[str, int] = field(default_factory=dict, metadata={"optional": True})
    round_losses: list[float] = field(default_factory=list)  # train losses since the last sync started
    val_losses: list[list[float]] = field(default_factory=list)  # [step, val loss] of every eval
    worker_compute_s: float = 0.0  # one worker's inner-step compute (mean over replicas), all sessions
    elapsed_s: float = 0.0  # wall time of the run (all sessions) at the last checkpoint
    # Time in training rounds (evaluations and checkpoints left out), all sessions: eval records' train_s.
    train_s: float = field(default=0.0, metadata={"optional": True})

    def summary(self) -> dict[str, Any]:
        val = [v for _, v in self.val_losses]
        return {
            "final_val_loss": val[-1] if val else None,
            "initial_val_loss": val[0] if val else None,
            "best_val_loss": min(val) if val else None,
            "inner_steps": self.steps,
            "outer_steps": self.outer_steps,
            "fragment_syncs": self.fragment_syncs,
            "contributions_excluded": dict(self.excluded),
            "worker_compute_s": round(self.worker_compute_s, 3),
        }

    def step_time_s(self) -> float:
        """Mean compute of one inner step of one worker so far."""
        return self.worker_compute_s / max(self.steps, 1)


@dataclass
class CommLedger(Component):
    """Bytes one worker sent (as if every replica were its own node), the largest single sync, one
    replica's message per fragment, and the time spent waiting for reductions."""

    num_params: int = field(default=0, metadata={"state": False})
    bytes_sent: float = 0.0
    peak_bytes_per_sync: float = 0.0
    payload_by_fragment: dict[int, float] = field(default_factory=dict)
    comm_wait_s: float = 0.0
    # What this rank sent itself: bytes_sent on a worker's lead; 1/R of it per rank of a sharded worker.
    rank_bytes_sent: float = field(default=0.0, metadata={"optional": True})

    def count(self, sent: float, own: float | None = None) -> None:
        """`sent` by the worker in one sync, `own` of it by this rank (default: all of it)."""
        self.bytes_sent += sent
        self.rank_bytes_sent += sent if own is None else own
        self.peak_bytes_per_sync = max(self.peak_bytes_per_sync, sent)

    def summary(self) -> dict[str, Any]:
        payload = sum(self.payload_by_fragment.values()) or None  # one replica's message, whole model
        return {
            "bytes_sent_per_worker": self.bytes_sent,
            "bytes_sent_by_rank0": self.rank_bytes_sent,
            "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "payload_bytes_per_sync": payload,
            "effective_bits_per_param": round(8 * payload / self.num_params, 4) if payload else None,
            "comm_wait_s": round(self.comm_wait_s, 3),
        }


@dataclass
class WanProjection(Component):
    """The WAN planner (backend.local.bandwidth_mbps): every transfer's time on the configured link, and
    the part of it not hidden behind overlapped inner steps."""

    link: Link | None = field(default=None, metadata={"state": False})
    progress: Progress | None = field(default=None, metadata={"state": False})
    network_s: float = 0.0
    wait_s: float = 0.0

    def project(self, seconds: float, overlap_steps: int) -> None:
        """A transfer of `seconds`, hidden behind `overlap_steps` inner steps at the mean step time."""
        self.network_s += seconds
        self.wait_s += max(0.0, seconds - overlap_steps * self.progress.step_time_s())

    def summary(self) -> dict[str, Any]:
        if self.link is None:
            return {}
        compute = self.progress.worker_compute_s
        wall = compute + self.wait_s
        return {
            "projected_bandwidth_mbps": self.link.bandwidth_mbps,
            "projected_latency_ms": self.link.latency_ms,
            "projected_compute_s": round(compute, 3),
            "projected_network_s": round(self.network_s, 3),
            "projected_wall_s": round(wall, 3),
            "projected_wall_s_no_overlap": round(compute + self.network_s, 3),
            "projected_network_wait_fraction": round(self.wait_s / wall, 4) if wall > 0 else None,
        }
