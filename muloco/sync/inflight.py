"""A sync between its start and its application (`InFlightSync`), and what its application reports
(`SyncRecord`). Streaming DiLoCo keeps a sync in flight for tau inner steps; a checkpoint taken meanwhile
keeps the mean itself, so a resumed run applies exactly the same update at the same step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muloco.sync.reduce import Mean, PendingMean


@dataclass
class InFlightSync:
    """A fragment's sync between its start (pseudogradients sent) and its application (outer step)."""

    fragment: int
    started_step: int
    apply_step: int
    result: PendingMean
    stats: dict[str, Any] = field(default_factory=dict)  # what the sync's record reports

    def state_dict(self) -> dict[str, Any]:
        """Checkpointing drains the transfer (waits for the mean) and saves the mean itself."""
        return {
            "fragment": self.fragment,
            "started_step": self.started_step,
            "apply_step": self.apply_step,
            "mean": self.result.wait().state_dict(),  # plain types: torch.load(weights_only=True)
            "stats": self.stats,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> InFlightSync:
        result = PendingMean.completed(Mean(**state["mean"]))
        return cls(state["fragment"], state["started_step"], state["apply_step"], result, state["stats"])


@dataclass
class SyncRecord:
    """One applied sync, for the log: `fields` go into the metrics record as they are; `sums` are
    (sum, count) pairs over this process's replicas that the caller averages over all processes."""

    fragment: int
    started_step: int
    step: int  # the inner step it was applied at
    outer_step: int
    fields: dict[str, Any]
    sums: dict[str, tuple[float, int]]
