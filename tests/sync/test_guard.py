"""The non-finite guard (sync/guard.py): bad syncs in a row, reset by a good one, stop at the limit."""

import math

import pytest

from muloco.errors import TrainingError
from muloco.sync.counters import Progress
from muloco.sync.guard import BadSyncGuard, usable


class Health:
    def __init__(self, healthy):
        self.healthy = healthy


def test_only_a_healthy_replica_with_a_finite_norm_is_usable():
    assert usable(Health(True), 1.0)
    assert not usable(Health(False), 1.0)
    assert not usable(Health(True), math.nan) and not usable(Health(True), math.inf)


def test_bad_syncs_count_in_a_row_and_stop_the_run_at_the_limit():
    progress = Progress()
    guard = BadSyncGuard(progress, workers=4, max_bad_syncs=2)
    guard.record(1, "sync 1")
    assert progress.bad_syncs == 1
    guard.record(0, "sync 2")  # a clean sync resets the count
    assert progress.bad_syncs == 0
    guard.record(2, "sync 3")
    with pytest.raises(TrainingError, match=r"2 syncs in a row .* \(train.max_bad_syncs = 2\)"):
        guard.record(1, "sync 4")
