"""A sync between its start and its application (`InFlightSync`), and what its application reports
(`SyncRecord`). Streaming DiLoCo keeps a sync in flight for tau inner steps; a checkpoint taken meanwhile
keeps the mean itself, so a resumed run applies exactly the same update at the same step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from muloco.sync.reduce import Mean, PendingMean


class SumCount(NamedTuple):
    """A sum over this process's replicas and how many values it holds: the caller averages it over the
    processes (comm.means_over_processes), so that every process logs the run's mean."""

    total: float = 0.0
    count: int = 0


@dataclass
class InFlightSync:
    """A fragment's sync between its start (pseudogradients sent) and its application (outer step)."""

    fragment: int
    started_step: int
    apply_step: int
    result: PendingMean
    loss: SumCount = SumCount()  # the train losses of the round it closes (the caller's)
    norm: SumCount = SumCount()  # the healthy replicas' pseudogradient norms
    fields: dict[str, Any] = field(default_factory=dict)  # what its record reports as it is

    def state_dict(self) -> dict[str, Any]:
        """Checkpointing drains the transfer (waits for the mean) and saves the mean itself."""
        return {
            "fragment": self.fragment,
            "started_step": self.started_step,
            "apply_step": self.apply_step,
            "mean": self.result.wait().state_dict(),  # plain types: torch.load(weights_only=True)
            "loss": tuple(self.loss),
            "norm": tuple(self.norm),
            "fields": self.fields,
        }

    def record(
        self,
        mean: Mean,
        step: int,
        outer_step: int,
        update_norm: float | None,
        left_out: int,
        streaming: bool,
    ) -> SyncRecord:
        """What the sync's application reports: applied at inner step `step` as outer step `outer_step`."""
        reported = dict(self.fields)
        fields = {
            "pseudograd_cosine": reported.pop("pseudograd_cosine", None),
            "outer_update_norm": update_norm,
            "outer_step": outer_step,
            "replicas_left_out": left_out,
            **({"contributions_excluded": mean.excluded} if mean.excluded else {}),
            "payload_bytes": reported.pop("payload_bytes", None),
            "bits_per_param": reported.pop("bits_per_param", None),
            **reported,  # the alignment statistics (diagnostics.alignment)
            **({"fragment": self.fragment, "started_step": self.started_step} if streaming else {}),
            **mean.details,
        }
        return SyncRecord(self.fragment, self.started_step, step, outer_step, fields, self.loss, self.norm)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> InFlightSync:
        result = PendingMean.completed(Mean(**state["mean"]))
        if "stats" in state:  # a checkpoint of muloco <= 0.1.0: the sums among the fields, as pairs
            fields = dict(state["stats"])
            loss, norm = fields.pop("loss_sum_count", (0.0, 0)), fields.pop("norm_sum_count", (0.0, 0))
            fields.update(fields.pop("alignment", {}))
        else:
            loss, norm, fields = state["loss"], state["norm"], state["fields"]
        where = (state["fragment"], state["started_step"], state["apply_step"], result)
        return cls(*where, SumCount(*loss), SumCount(*norm), fields)


@dataclass
class SyncRecord:
    """One applied sync, for the log: `fields` go into the metrics record as they are; `loss` and `norm`
    are sums over this process's replicas that the caller averages over all processes."""

    fragment: int
    started_step: int
    step: int  # the inner step it was applied at
    outer_step: int
    fields: dict[str, Any]
    loss: SumCount
    norm: SumCount
