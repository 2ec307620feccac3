"""`SwarmReducer` (sync/swarm.py) against a fake swarm: joining loads the swarm's state through the engine's
`SharedState`, a peer behind the swarm catches up after a sync, and never while a sync is in flight. (Real
swarms: tests/comm/hivemind/, slow.)"""

import math
import time

import pytest
import torch

from muloco.comm.digest import state_digest
from muloco.config import HivemindBackendConfig, OuterConfig, SyncConfig
from muloco.errors import TrainingError
from muloco.run.replica import Replica
from muloco.sync import Mean, SumCount, SyncEngine
from muloco.sync.reduce import PendingMean
from muloco.sync.swarm import SwarmReducer, _reference


class FakeSwarm:
    """What SwarmReducer asks of HivemindSwarm: state sharing and progress records."""

    peer_id = "me"

    def __init__(self, donor_state, others):
        self.donor_state, self.others = donor_state, others  # others: peer id -> published progress
        self.published, self.shared, self.asked = [], None, []

    def load_state_from_peers(self, like, timeout, donors=None, min_progress=0, digests=None):
        self.asked.append((donors, min_progress))
        if self.donor_state is None:
            return None
        tensors, meta = self.donor_state
        assert [t.shape for t in tensors] == [t.shape for t in like]
        return tensors, meta, "donor"

    def share_state(self, tensors, meta):
        self.shared = ([t.clone() for t in tensors], dict(meta))
        return state_digest(tensors)

    def publish_outer_step(self, progress, digest=b""):
        self.published.append(progress)

    def peer_outer_steps(self):
        return {"me": self.published[-1] if self.published else 0, **self.others}


class FakeSwarmReducer(SwarmReducer):
    def open(self, shapes, codecs):
        self.swarm = FakeSwarm(None, {})


def engine_and_replica(initial_peers):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    section = HivemindBackendConfig(initial_peers=initial_peers, wait_for_peers=2, join_timeout_s=5)
    engine = SyncEngine(
        model,
        FakeSwarmReducer(section),
        sync=SyncConfig(every=2),
        outer=OuterConfig(),
        compression=None,
        local_replicas=1,
        max_bad_syncs=3,
        total_steps=10,
    )
    replica = Replica(0, model, torch.optim.SGD(model.parameters(), lr=0.1), None, torch.device("cpu"))
    return engine, replica, engine.reducer.swarm


def swarm_state(engine, value, step):
    params = [torch.full_like(p, value) for p in engine.global_params]
    momentum = [torch.zeros_like(p) for p in engine.global_params]
    return [*params, *momentum], {"step": step, "outer_steps": step // 2, "fragment_syncs": step // 2}


def test_a_joiner_loads_the_swarms_state_then_serves_it():
    engine, replica, swarm = engine_and_replica(["/ip4/127.0.0.1/tcp/1/p2p/QmPeer"])
    swarm.donor_state = swarm_state(engine, 0.5, step=6)
    swarm.others = {"donor": 3}
    engine.join([replica], resumed=False)
    assert engine.progress.steps == 6 and engine.progress.fragment_syncs == 3 and replica.inner_steps == 6
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in replica.model.parameters())
    tensors, meta = swarm.shared
    assert meta["step"] == 6 and torch.equal(tensors[0], engine.global_params[0])
    assert swarm.published == [3]  # its progress, then it found wait_for_peers=2 peers


def test_a_resumed_peer_or_the_first_keeps_its_own_state():
    engine, replica, swarm = engine_and_replica([])
    swarm.donor_state = swarm_state(engine, 0.5, step=6)
    swarm.others = {"other": 0}
    engine.join([replica], resumed=False)
    assert engine.progress.steps == 0 and swarm.shared[1]["step"] == 0


def test_a_peer_behind_catches_up_after_a_sync_but_not_with_a_sync_in_flight():
    engine, replica, swarm = engine_and_replica([])
    swarm.others = {"other": 0}
    engine.join([replica], resumed=False)
    swarm.donor_state = swarm_state(engine, 0.25, step=8)
    swarm.others = {"other": 4}  # the swarm is 4 fragment syncs ahead
    engine.in_flight.append(object())
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details={"group_size": 2}), [replica])
    assert engine.progress.steps == 0  # never while a sync is in flight
    engine.in_flight.clear()
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details={"group_size": 2}), [replica])
    assert engine.progress.steps == 8 and engine.progress.fragment_syncs == 4
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in replica.model.parameters())


def test_a_peer_a_sync_behind_its_group_catches_up_before_the_group_publishes_it():
    """The group's metadata showed its members a step ahead (behind_group): the swarm's published progress
    does not show it yet (they are finishing this round), and the peer still loads a state past its own
    progress. Without this it met them a sync behind every round (the WAN headline's hivemind row)."""
    engine, replica, swarm = engine_and_replica([])
    swarm.others = {"other": 0}
    engine.join([replica], resumed=False)
    swarm.donor_state = swarm_state(engine, 0.25, step=2)
    behind = {"group_size": 4, "behind_group": True}
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details=behind), [replica])
    assert swarm.asked[-1] == (None, 1)  # a state past this peer's progress (0), from any donor
    assert engine.progress.steps == 2 and engine.progress.fragment_syncs == 1
    assert all(torch.equal(p, torch.full_like(p, 0.25)) for p in replica.model.parameters())


PEERS = [f"Qm{c * 44}" for c in "ABCD"]  # base58 peer ids, ordered A < B < C < D by their bytes


def test_the_group_majority_decides_who_reloads_and_from_whom():
    a, b, c, d = PEERS
    x, y = b"x" * 16, b"y" * 16
    assert _reference({a: x, b: x, c: y}, x) is None  # in the majority
    assert _reference({a: x, b: x, c: y}, y) == (a, x)  # the minority loads the majority's lowest peer
    assert _reference({a: y, b: x, c: x}, y) == (b, x)  # even when it has the lowest id itself
    assert _reference({a: x, b: y, c: y, d: x}, y) == (a, x)  # a tie: the digest of the lowest peer id
    assert _reference({a: x, b: y, c: y, d: x}, x) is None
    assert _reference({}, x) is None


def test_a_peer_whose_state_differs_from_its_groups_loads_the_reference_after_the_sync():
    engine, replica, swarm = engine_and_replica([])
    swarm.others = {"other": 0}
    engine.join([replica], resumed=False)
    swarm.donor_state = swarm_state(engine, 0.75, step=0)
    details = {
        "group_size": 3,
        "state_digest": "00",
        "state_reference": PEERS[0],
        "state_reference_digest": "11",
    }
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details=details), [replica])
    assert swarm.asked[-1][1] == 0 and str(swarm.asked[-1][0][0]) == PEERS[0]  # that peer, this progress
    assert all(torch.equal(p, torch.full_like(p, 0.75)) for p in replica.model.parameters())


class Record:
    def __init__(self, progress, digest, published=0.0):
        self.progress, self.digest, self.published = progress, digest, published


def test_with_a_robust_rule_one_insiders_claims_do_not_make_a_peer_reload():
    """tolerate = sync.trim = 1: a progress claim or a state counts only when 2 peers back it."""
    engine, replica, swarm = engine_and_replica([])
    engine.reducer.tolerate = 1
    swarm.others = {"honest": 0}
    engine.join([replica], resumed=False)
    swarm.others = {"honest": 0, "insider": 10**6}  # one peer claims to be far ahead
    swarm.donor_state = swarm_state(engine, 0.25, step=8)
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details={"group_size": 2}), [replica])
    assert engine.progress.steps == 0 and not swarm.asked  # not behind: only one peer says so
    swarm.others = {"honest": 4, "insider": 10**6}  # now two peers are ahead
    swarm.peer_records = lambda: {"a": Record(4, b"h" * 16), "b": Record(10**6, b"x" * 16)}
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details={"group_size": 2}), [replica])
    assert engine.progress.steps == 0 and not swarm.asked  # behind, but no state that 2 peers announce
    swarm.peer_records = lambda: {"a": Record(4, b"h" * 16), "c": Record(4, b"h" * 16)}
    engine.reducer.after_sync(engine, Mean(None, 0, 0, details={"group_size": 2}), [replica])
    assert swarm.asked[-1] == (None, 1) and engine.progress.steps == 8  # the backed state, never older


# -- exclusions are not divergence (issue 37) ---------------------------------------------------------------


def sync_with(engine, replica, mean):
    """One sync of the fake swarm peer whose reducer returns `mean`."""
    engine.reducer.start_mean = lambda contribution: PendingMean.completed(mean)
    started = engine.start(0, [replica], 2, SumCount(0.0, 1))
    return engine.finish(started, [replica])


def test_contributions_excluded_for_any_reason_never_end_the_run_and_are_counted_by_kind():
    engine, replica, swarm = engine_and_replica([])
    engine.reducer.after_sync = lambda *args: None
    others = {"other_step": 4}  # e.g. a peer that fell behind, in every group: never a bad sync
    no_group = Mean(None, 0, 0, details={"group_size": 1})  # no group, or behind it: no mean at all
    for _ in range(4):
        record = sync_with(engine, replica, Mean(None, 0, 0, excluded=dict(others)))
        assert record.fields["replicas_left_out"] == 0 and record.fields["contributions_excluded"] == others
        sync_with(engine, replica, no_group)
    assert engine.progress.bad_syncs == 0 and engine.progress.excluded == {"other_step": 16}
    assert engine.progress.summary()["contributions_excluded"] == {"other_step": 16}


def test_only_this_peers_own_non_finite_contribution_or_an_overflowed_mean_is_a_bad_sync():
    engine, replica, swarm = engine_and_replica([])
    engine.reducer.after_sync = lambda *args: None
    sync_with(engine, replica, Mean(None, 0, 1))  # its own replica sat out
    assert engine.progress.bad_syncs == 1
    overflowed = [torch.full_like(p, math.inf) for p in engine.global_params]
    sync_with(engine, replica, Mean(overflowed, 2, 0))  # finite inputs, a non-finite mean
    assert engine.progress.bad_syncs == 2
    with pytest.raises(TrainingError, match="the run diverged"):
        sync_with(engine, replica, Mean(None, 0, 1))


# -- the final agreement (issue 37) -------------------------------------------------------------------------


class Timeouts:
    averaging_timeout = 0.5  # conclude waits at most 2 x this


def concluding(others, donor_value=None):
    """A fake peer at the end of its run (3 fragment syncs), PEERS[3] itself; others: peer -> (progress,
    digest, seconds since published)."""
    engine, replica, swarm = engine_and_replica([])
    engine.progress.fragment_syncs, engine.progress.steps = 3, 6
    swarm.peer_id, swarm.timeouts = PEERS[3], [Timeouts()]
    if donor_value is not None:
        swarm.donor_state = swarm_state(engine, donor_value, step=6)
    now = time.time()
    swarm.peer_records = lambda: {p: Record(n, d, now - age) for p, (n, d, age) in others.items()}
    return engine, replica, swarm


def test_peers_that_finished_with_the_same_model_agree_at_once():
    engine, replica, swarm = concluding({})
    own = state_digest(engine.export_state()[0])
    swarm.peer_records = lambda: {p: Record(3, own, time.time()) for p in PEERS[:2]}
    t0 = time.monotonic()
    engine.conclude([replica], on_failure=pytest.fail)
    assert time.monotonic() - t0 < 0.5 and not swarm.asked
    assert engine.conclusion == {"final_state_digest": own.hex(), "realigned_at_end": False}


def test_a_peer_whose_final_model_differs_from_the_majority_loads_it():
    engine, replica, swarm = concluding({}, 0.75)
    majority = state_digest(swarm.donor_state[0])
    swarm.peer_records = lambda: {p: Record(3, majority, time.time()) for p in PEERS[:2]}
    t0 = time.monotonic()
    engine.conclude([replica], on_failure=pytest.fail)
    assert time.monotonic() - t0 < 0.9  # agreed once loaded, before the deadline
    assert str(swarm.asked[0][0][0]) == PEERS[0] and swarm.asked[0][1] == 3  # the reference, at the end
    assert all(torch.equal(p, torch.full_like(p, 0.75)) for p in replica.model.parameters())
    assert engine.conclusion["realigned_at_end"] is True


def test_a_load_that_ends_past_the_deadline_still_counts():
    engine, replica, swarm = concluding({}, 0.75)
    majority = state_digest(swarm.donor_state[0])
    swarm.peer_records = lambda: {p: Record(3, majority, time.time()) for p in PEERS[:2]}
    honest_load = swarm.load_state_from_peers

    def slow_load(*args, **kwargs):
        time.sleep(1.2)  # beyond the 1 s deadline
        return honest_load(*args, **kwargs)

    swarm.load_state_from_peers = slow_load
    engine.conclude([replica], on_failure=pytest.fail)
    assert engine.conclusion["realigned_at_end"] is True


def test_a_peer_that_cannot_load_the_majoritys_model_fails_after_its_checkpoint():
    majority = b"m" * 16
    engine, replica, swarm = concluding({PEERS[0]: (3, majority, 0), PEERS[1]: (3, majority, 0)})
    saved = []
    with pytest.raises(TrainingError, match="differs from the swarm's majority"):
        engine.conclude([replica], on_failure=lambda: saved.append(True))
    assert saved == [True]  # its own model is kept


def test_the_majority_waits_for_a_peer_still_running_but_not_for_one_that_left():
    own = None
    for age, waits in ((0.0, True), (60.0, False)):  # a record 60 s old: a peer that left
        engine, replica, swarm = concluding({PEERS[0]: (2, b"r" * 16, age)})
        own = state_digest(engine.export_state()[0])
        t0 = time.monotonic()
        engine.conclude([replica], on_failure=pytest.fail)
        assert (time.monotonic() - t0 >= 1.0) == waits  # the deadline: 2 x averaging_timeout
        assert engine.conclusion["final_state_digest"] == own.hex()
