"""A straggler's deadline (sync.deadline: adaptive; docs/heterogeneous.md): how long the workers that are
ready wait for the others at a round's sync, from the round times measured so far, and the counts of what
the deadline left out (summary.json).

The deadline of a round is median + max(k x MAD, MIN_SLACK x median) of the last WINDOW rounds' times (from
the end of the previous sync's exchange, the same moment for all its members, to this worker's contribution
being ready), k = sync.deadline_mads: the median and
the median absolute deviation are robust to the stragglers they are there to bound (a stalled round does
not move them much), and the slack keeps equal hosts, whose MAD is near 0, from missing the deadline by a
few percent of noise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from muloco.sync.counters import Component, wiring

WINDOW = 20  # rounds measured: recent enough to follow a host that slows down for good
MIN_ROUNDS = 3  # before this many, no deadline of our own: the backend's static matchmaking wait
# x median, generous: equal hosts' rounds differ by a few percent, and a worker that misses the deadline by
# noise idles until the next sync, which costs far more than the wait
MIN_SLACK = 0.2


@dataclass
class RoundDeadline(Component):
    """The recent round times and the deadline they give. Not checkpointed as timing (a resumed run
    measures its own rounds again); the counts of late and lost work are."""

    mads: float = wiring(3.0)  # k: MADs above the median
    times: list[float] = field(default_factory=list, metadata={"state": False})
    late_contributions: int = 0  # this worker's windows that arrived late and joined the next sync
    lost_windows: int = 0  # this worker's windows that arrived more than a sync late: left out
    lost_steps: int = 0  # the inner steps of those windows
    absent: int = 0  # over this worker's syncs: the workers missing from its group (K - group size)

    def observe(self, seconds: float) -> None:
        """One round's compute time (a round in which this worker was on time)."""
        self.times = [*self.times[-(WINDOW - 1) :], float(seconds)]

    def seconds(self) -> float | None:
        """The deadline measured from a round's start, or None while fewer than MIN_ROUNDS are known."""
        if len(self.times) < MIN_ROUNDS:
            return None
        median = statistics.median(self.times)
        mad = statistics.median(abs(t - median) for t in self.times)
        return median + max(self.mads * mad, MIN_SLACK * median)

    def summary(self) -> dict[str, Any]:
        deadline = self.seconds()
        return {
            "deadline_s": round(deadline, 3) if deadline is not None else None,
            "late_contributions": self.late_contributions,
            "lost_windows": self.lost_windows,
            "lost_steps": self.lost_steps,
            "absent_contributions": self.absent,
        }
