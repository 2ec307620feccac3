"""sync.deadline: adaptive (sync/deadline.py, sync/swarm.py): the deadline's median + k x MAD by hand; a peer
on time waits for the others until the deadline; a window the swarm went on without joins the next sync
(counted late, announcing no state digest), or more than a sync late is lost (counted); the backends that
cannot go on without a worker refuse it in one line. (A real swarm with a stalled peer:
tests/comm/test_hivemind_training.py.)"""

import time
from types import SimpleNamespace

import pytest
import torch

from muloco.config import HivemindBackendConfig, load_config
from muloco.sync.codec import pack
from muloco.sync.deadline import RoundDeadline
from muloco.sync.reduce import Contribution

pytest.importorskip("hivemind")
from muloco.comm.hivemind.exchange import AverageResult  # noqa: E402
from muloco.sync.swarm import SwarmReducer, _reference  # noqa: E402


def test_the_deadline_is_the_median_plus_k_mads_with_a_floor_of_a_fifth():
    d = RoundDeadline(mads=3.0)
    for t in (1.0, 1.2):
        d.observe(t)
    assert d.seconds() is None  # fewer than 3 rounds: the backend's own wait
    for t in (0.9, 1.1, 5.0):
        d.observe(t)
    # median 1.1; |t - 1.1| = 0.1, 0.1, 0.2, 0, 3.9: MAD 0.1; 1.1 + max(3 x 0.1, 0.22)
    assert d.seconds() == pytest.approx(1.4)
    equal = RoundDeadline(mads=3.0, times=[2.0, 2.0, 2.0])
    assert equal.seconds() == pytest.approx(2.4)  # MAD 0: the floor, 20% over the median
    for _ in range(25):
        d.observe(3.0)
    assert d.seconds() == pytest.approx(3.6) and len(d.times) == 20  # the last 20 rounds only


class Handle:
    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self):
        return self.result


def averaged(group_size=3):
    return AverageResult([torch.ones(2)], group_size, 0, True, digests={})


def no_group():
    return AverageResult(None, 1, 0, False)


class FakeSwarm:
    """The swarm as the deadline sees it: the others' published progress, and the averages started."""

    peer_id = "me"

    def __init__(self, others, results):
        self.others, self.results, self.started = others, list(results), []

    def peer_outer_steps(self):
        return dict(self.others)

    def start_average_encoded(self, fragment, payloads, step, rule, digest, wait_s, late):
        self.started.append({"step": step, "digest": digest, "wait_s": wait_s, "late": late})
        return Handle(self.results.pop(0))


def reducer_at(progress, others, results, times=(1.0, 1.0, 1.0), total_steps=100):
    reducer = SwarmReducer(
        HivemindBackendConfig(), workers=3, deadline=RoundDeadline(times=list(times)), every=10,
        total_steps=total_steps,
    )  # fmt: skip
    reducer.swarm, reducer.digest = FakeSwarm(others, results), b"d" * 16
    reducer._begin_round(SimpleNamespace(fragment_syncs=progress))
    return reducer


def contribution(step):
    return Contribution(
        fragment=0, step=step, healthy=1, like=[torch.zeros(2)], payload_bytes=4.0, messages=[pack([b"x"])],
        codec=object(),
    )  # fmt: skip


def test_a_peer_on_time_waits_for_the_others_until_the_deadline():
    reducer = reducer_at(progress=4, others={"a": 4, "b": 4}, results=[averaged()])
    reducer._round_started = time.monotonic() - 0.5  # half a round of compute behind it
    pending = reducer.start_mean(contribution(50))
    gone = time.monotonic() - reducer._round_started
    mean = pending.wait()
    (started,) = reducer.swarm.started
    assert started["step"] == 50 and started["digest"] == b"d" * 16
    assert 1.2 - gone <= started["wait_s"] <= 0.7  # the deadline 1.2 s from the round's start, 0.5 s gone
    assert "late" not in mean.details and reducer.membership.late_contributions == 0
    # the sync record says how the round went against its deadline
    assert mean.details["deadline_s"] == 1.2 and 0.5 <= mean.details["round_s"] <= gone
    assert len(reducer.membership.times) == 4  # this round's time, measured
    assert time.monotonic() - reducer._round_started < 0.5  # the next round begins as the sync ends


def test_a_window_the_swarm_went_on_without_joins_the_next_sync_counted():
    reducer = reducer_at(progress=4, others={"a": 5, "b": 5}, results=[averaged()])
    mean = reducer.start_mean(contribution(50)).wait()
    (started,) = reducer.swarm.started
    # the others' next sync (step 60), no state digest (its state is a sync behind: no engine here to
    # take the swarm's), short searches (wait 0: hivemind's own matchmaking time)
    assert started == {"step": 60, "digest": b"", "wait_s": 0.0, "late": True}
    assert mean.details["late"] is True and mean.details["joined_step"] == 60 and mean.values is not None
    assert reducer.membership.late_contributions == 1 and reducer.membership.lost_windows == 0
    assert len(reducer.membership.times) == 3  # a late round is not a round time


def test_a_search_without_a_group_retries_at_the_next_sync_once_the_others_published_it():
    reducer = reducer_at(progress=4, others={"a": 4, "b": 4}, results=[no_group(), averaged()])
    pending = reducer.start_mean(contribution(50))
    reducer.swarm.others = {"a": 5, "b": 5}  # they finished their exchange while this peer searched
    mean = pending.wait()
    assert [s["step"] for s in reducer.swarm.started] == [50, 60]
    assert reducer.swarm.started[1]["digest"] == b"" and mean.details["late"] is True
    assert reducer.membership.late_contributions == 1


def test_a_search_without_a_group_after_which_the_others_are_two_syncs_on_is_lost_and_recorded_so():
    reducer = reducer_at(progress=4, others={"a": 4, "b": 4}, results=[no_group()])
    pending = reducer.start_mean(contribution(50))
    reducer.swarm.others = {"a": 6, "b": 6}  # this peer stalled in its search while they synced twice
    mean = pending.wait()
    assert [s["step"] for s in reducer.swarm.started] == [50] and mean.details["lost_window"]
    assert "late" not in mean.details and reducer.membership.late_contributions == 0
    assert (reducer.membership.lost_windows, reducer.membership.lost_steps) == (1, 10)


def test_more_than_a_sync_late_or_late_for_the_last_sync_is_lost_and_counted():
    reducer = reducer_at(progress=4, others={"a": 6, "b": 6}, results=[])
    mean = reducer.start_mean(contribution(50)).wait()
    assert reducer.swarm.started == [] and mean.values is None and mean.details["lost_window"]
    assert (reducer.membership.lost_windows, reducer.membership.lost_steps) == (1, 10)
    last = reducer_at(progress=9, others={"a": 10}, results=[], total_steps=100)
    assert last.start_mean(contribution(100)).wait().details["lost_window"]
    assert last.membership.lost_windows == 1 and last.membership.late_contributions == 0
    # late for the sync before the last: the last one (the run's final step, not H on) is joined
    near = reducer_at(progress=8, others={"a": 9}, results=[averaged()], total_steps=95)
    near.start_mean(contribution(90)).wait()
    assert near.swarm.started[0]["step"] == 95


def test_a_peer_without_a_digest_takes_the_groups_and_never_leads_it():
    a, b, c = (f"Qm{x * 44}" for x in "ABC")
    x = b"x" * 16
    assert _reference({a: b"", b: x}, x) is None  # a pair: the late peer is never the majority
    assert _reference({a: b"", b: x}, b"") == (b, x)
    assert _reference({a: b"", b: x, c: x}, b"") == (b, x)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["backend.kind=torch"], "torch.distributed group is fixed"),
        (["backend.kind=local"], "never late"),
        (["backend.kind=torchft"], "lighthouse decides when a quorum forms"),
        (["backend.kind=hivemind", "sync.fragments=2"], "one fragment without overlap"),
        (["backend.kind=hivemind", "sync.mode=async"], "sync.mode=sync"),
    ],
)
def test_where_a_deadline_cannot_go_on_without_a_worker_it_is_refused_in_one_line(overrides, words):
    with pytest.raises(ValueError) as error:
        load_config("configs/quickstart.yaml", ["sync.deadline=adaptive", "sync.every=10", *overrides])
    assert words in str(error.value) and "sync.deadline" in str(error.value)


def test_a_late_window_searches_again_until_the_others_arrive_or_go_on_once_more():
    reducer = reducer_at(progress=4, others={"a": 5, "b": 5}, results=[no_group(), no_group(), averaged()])
    mean = reducer.start_mean(contribution(50)).wait()
    assert [s["step"] for s in reducer.swarm.started] == [60, 60, 60] and mean.details["late"] is True
    assert "lost_window" not in mean.details
    gone = reducer_at(progress=4, others={"a": 5, "b": 5}, results=[no_group(), averaged()])
    pending = gone.start_mean(contribution(50))
    gone.swarm.others = {"a": 6, "b": 6}  # they synced again without it: no more searches
    lost = pending.wait()
    assert lost.values is None and lost.details["lost_window"] and len(gone.swarm.started) == 1
    assert (gone.membership.late_contributions, gone.membership.lost_windows) == (0, 1)  # lost after all
