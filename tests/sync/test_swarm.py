"""`SwarmReducer` (sync/swarm.py) against a fake swarm: joining loads the swarm's state through the engine's
`SharedState`, a peer behind the swarm catches up after a sync, and never while a sync is in flight. (Real
swarms: tests/comm/hivemind/, slow.)"""

import torch

from muloco.config import HivemindBackendConfig, OuterConfig, SyncConfig
from muloco.replica import Replica
from muloco.sync import Mean, SyncEngine
from muloco.sync.swarm import SwarmReducer


class FakeSwarm:
    """What SwarmReducer asks of HivemindSwarm: state sharing and progress records."""

    peer_id = "me"

    def __init__(self, donor_state, others):
        self.donor_state, self.others = donor_state, others  # others: peer id -> published progress
        self.published, self.shared = [], None

    def load_state_from_peers(self, timeout):
        return self.donor_state

    def share_state(self, get_state):
        self.shared = get_state

    def publish_outer_step(self, progress):
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
    tensors, meta = swarm.shared()
    assert meta["step"] == 6 and torch.equal(tensors[0], engine.global_params[0])
    assert swarm.published == [3]  # its progress, then it found wait_for_peers=2 peers


def test_a_resumed_peer_or_the_first_keeps_its_own_state():
    engine, replica, swarm = engine_and_replica([])
    swarm.donor_state = swarm_state(engine, 0.5, step=6)
    swarm.others = {"other": 0}
    engine.join([replica], resumed=False)
    assert engine.progress.steps == 0 and swarm.shared()[1]["step"] == 0


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
