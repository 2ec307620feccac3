"""Log records wait for their means over the processes without stopping a round (pending_records.py)."""

from __future__ import annotations

import torch

from muloco.comm import ProcessMeans
from muloco.run.pending_records import PendingRecords

TIMING = (30720, 100, 1.5, 0.0)  # timed_record's tokens, total_steps, elapsed, bytes_sent


class Arriving:
    """An all-reduce's handle that arrives when told (as one over a slow link does)."""

    def __init__(self, total: list[float]) -> None:
        self.total, self.arrived, self.waited = torch.tensor(total, dtype=torch.float64), False, False

    def done(self) -> bool:
        return self.arrived

    def wait(self) -> list[torch.Tensor]:
        self.waited = True  # a blocking wait: the handle's result is there once it returns
        return [self.total]


class TwoProcesses:
    rank, world_size = 0, 2

    def __init__(self, handle: Arriving) -> None:
        self.handle = handle

    def all_reduce_sum(self, tensors):
        return self.handle


def means_of(total: list[float]) -> tuple[ProcessMeans, Arriving]:
    handle = Arriving(total)
    return ProcessMeans(TwoProcesses(handle), (0.0, 0)), handle


def test_a_round_writes_only_the_records_whose_means_arrived_in_order():
    pending, written = PendingRecords(), []
    first, first_handle = means_of([6.0, 3.0])
    second, second_handle = means_of([8.0, 2.0])
    pending.add("sync", 15, TIMING, first, ("train_loss",), {"outer_step": 1})
    pending.add("sync", 30, TIMING, second, ("train_loss",), {"outer_step": 2})

    second_handle.arrived = True  # the later one first: it must still wait for the earlier one
    pending.flush(written.append, block=False)
    assert written == [] and not first_handle.waited and len(pending) == 2

    first_handle.arrived = True
    pending.flush(written.append, block=False)
    assert [(r["step"], r["train_loss"], r["outer_step"]) for r in written] == [(15, 2.0, 1), (30, 4.0, 2)]
    assert len(pending) == 0


def test_a_blocking_flush_writes_every_record_and_counts_its_wait():
    pending, written = PendingRecords(), []
    means, handle = means_of([9.0, 3.0])
    pending.add("train", 7, TIMING, means, ("train_loss",), {})
    waited = pending.flush(written.append)  # before a checkpoint, an eval record, the run's end
    assert handle.waited and waited >= 0.0
    assert [(r["kind"], r["step"], r["train_loss"], r["time_s"]) for r in written] == [("train", 7, 3.0, 1.5)]


def test_one_process_means_are_ready_at_once():
    from muloco.comm import LocalBackend

    means = ProcessMeans(LocalBackend(), (6.0, 2), (1.0, 4))
    assert means.ready() and means() == [3.0, 0.25]
