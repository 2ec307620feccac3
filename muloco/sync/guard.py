"""The non-finite guard: a replica whose loss or pseudogradient is not finite sits a sync out (the mean is
over the healthy ones) and restarts from the global parameters; `train.max_bad_syncs` syncs in a row with
such a replica stop the run (docs/reliability.md)."""

from __future__ import annotations

import logging
import math

from muloco.errors import TrainingError

log = logging.getLogger("muloco")


def usable(replica, norm: float) -> bool:
    """Whether a replica's pseudogradient may join the mean: it trained without a non-finite loss and the
    pseudogradient's norm is finite."""
    return replica.healthy and math.isfinite(norm)


class BadSyncGuard:
    """Counts syncs in a row that left a replica out; `max_bad_syncs` of them raise TrainingError (the last
    checkpoint, written before them, stays as it is)."""

    def __init__(self, progress, workers: int | None, max_bad_syncs: int) -> None:
        self.progress, self.workers, self.max_bad_syncs = progress, workers, max_bad_syncs

    def record(self, left_out: int, what: str) -> None:
        if left_out == 0:
            self.progress.bad_syncs = 0
            return
        self.progress.bad_syncs += 1
        of = f" of {self.workers}" if self.workers else ""
        log.warning("%s: %d%s replicas left out (non-finite)", what, left_out, of)
        if self.progress.bad_syncs >= self.max_bad_syncs:
            raise TrainingError(
                f"the run diverged: {self.progress.bad_syncs} syncs in a row had non-finite replicas "
                f"(train.max_bad_syncs = {self.max_bad_syncs}); lower inner.lr / outer.lr or raise "
                "train.warmup_steps, then resume from the last checkpoint (checkpoint.resume=auto)"
            )
