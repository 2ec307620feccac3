"""`ElasticReducer` (sync/elastic.py) against a fake torchft group: a failed sync is retried in a new quorum
with the same contribution, a worker behind adopts the quorum's state and contributes nothing, a quorum
that never forms fails the run with one line. (Real quorums: tests/comm/test_torchft.py, slow.)"""

from pathlib import Path

import pytest
import torch

from muloco.comm.digest import state_digest
from muloco.comm.torchft_group import QuorumFailed
from muloco.compress import ErrorFeedback
from muloco.config import OuterConfig, SyncConfig, TorchftBackendConfig, load_config
from muloco.diloco import DiLoCo
from muloco.errors import ConfigError, TrainingError
from muloco.run.replica import Replica
from muloco.sync import SumCount, SyncEngine
from muloco.sync.codec import pack
from muloco.sync.elastic import ElasticReducer
from muloco.sync.reduce import Contribution

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


class FakeGroup:
    """A quorum of this worker and scripted others. Each attempt: (others' flat sum or None for a failed
    collective, committed, a state to heal from or None); "no quorum" raises QuorumFailed."""

    def __init__(self, attempts, load_state):
        self.attempts, self.load_state = list(attempts), load_state
        self.size, self.quorum_id, self.current = 0, 0, None
        self.sent = []  # what this worker put into each collective

    def form_quorum(self):
        self.current = self.attempts.pop(0)
        if self.current == "no quorum":
            raise QuorumFailed("TimeoutError: quorum")
        self.quorum_id += 1
        self.size = self.current.get("size", 2)
        if self.current.get("heal") is not None:
            try:
                self.load_state(self.current["heal"])
            except ValueError as exc:  # torchft_group.form_quorum: a failed heal fails the quorum
                raise QuorumFailed(str(exc)) from None

    def all_reduce_sum(self, flat):
        self.sent.append(flat.clone())
        others = self.current["others"]
        return flat.add_(others) if others is not None else flat.fill_(float("nan"))

    def all_gather_bytes(self, payload, capacity=None):
        assert capacity is None or len(payload) <= capacity
        self.sent.append(payload)
        return [payload, *self.current["others"]]

    def commit(self):
        return self.current["commit"]

    def set_step(self, step):
        pass

    def wait_for_workers(self, count, timeout_s):
        pass

    def close(self):
        pass


def engine_and_replica(attempts, retries=3, sync=None):
    torch.manual_seed(0)
    model = (
        torch.nn.Linear(3, 2)
        if sync is None
        else torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    )

    class Reducer(ElasticReducer):
        def open(self, shapes, codecs):
            self._shapes, self._codecs = shapes, codecs
            self.group = FakeGroup(attempts, self._receive_state)

    section = TorchftBackendConfig(replica_id=0, quorum_retries=retries)
    engine = SyncEngine(
        model,
        Reducer(section, workers=2),
        sync=sync or SyncConfig(every=2),
        outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False),  # the outer step applies the mean as is
        compression=None,
        local_replicas=1,
        max_bad_syncs=3,
        total_steps=10,
    )
    replica = Replica(0, model, torch.optim.SGD(model.parameters(), lr=0.1), None, torch.device("cpu"))
    engine.join([replica], resumed=False)
    return engine, replica


def flat(tensors, count, healed):
    return torch.cat([t.reshape(-1) for t in tensors] + [torch.tensor([float(count), float(healed)])])


def sync(engine, replica, step=2):
    with torch.no_grad():
        for p in replica.model.parameters():
            p.sub_(0.5)  # this worker's pseudogradient: +0.5 everywhere
    replica.inner_steps = engine.progress.steps = step
    started = engine.start(0, [replica], step, SumCount(0.0, 1))
    return engine.finish(started, [replica])


def test_a_failed_sync_is_retried_in_a_new_quorum_with_the_same_contribution():
    other = [torch.full((2, 3), 0.1), torch.full((2,), 0.1)]  # the other member's pseudogradient
    attempts = [
        {"others": None, "commit": False},  # a member died mid-sync: the collective failed
        {"others": flat(other, 1, 0), "commit": True},
    ]
    engine, replica = engine_and_replica(attempts)
    start = [p.clone() for p in engine.global_params]
    record = sync(engine, replica)
    sent = engine.reducer.group.sent
    assert len(sent) == 2 and torch.equal(sent[0], sent[1])  # the same contribution both times
    for before, after in zip(start, engine.global_params, strict=True):
        torch.testing.assert_close(after, before - (0.5 + 0.1) / 2)
    assert record.fields["quorum_size"] == 2 and record.fields["replicas_left_out"] == 0
    assert engine.reducer.membership.retried_syncs == 1 and engine.reducer.membership.quorum_sizes == [2]


def donor_state(engine):
    """A healthy member's state (global parameters 2.0, no outer momentum), as _serve_state sends it."""
    tensors = [*(torch.full_like(p, 2.0) for p in engine.global_params)]
    tensors += [torch.zeros_like(p) for p in engine.global_params]
    meta = {"step": 8, "outer_steps": 4, "fragment_syncs": 4, "sync_fragment": 0, "sync_apply_step": 8}
    return {"tensors": tensors, "meta": meta, "digest": state_digest(tensors)}


def test_the_python_api_follows_a_quorum_that_moved_it():
    """muloco.DiLoCo runs the engine's round, as `muloco train` does: a worker healed into its quorum's
    sync at a later step applies that sync at once, at the quorum's step (before, the Python API kept it
    in flight and applied it a step late)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Reducer(ElasticReducer):
        def open(self, shapes, codecs):
            self._shapes, self._codecs = shapes, codecs
            self.group = FakeGroup([], self._receive_state)

    reducer = Reducer(TorchftBackendConfig(replica_id=0), workers=2)
    diloco = DiLoCo(model, opt, sync_every=2, outer_lr=1.0, outer_momentum=0.0, backend=reducer)
    donor = donor_state(diloco.engine)  # the quorum syncs at its step 8
    other = [torch.full((2, 3), 0.25), torch.full((2,), 0.25)]
    reducer.group.attempts = [{"others": flat(other, 1, 0), "commit": True, "heal": donor}]
    assert not diloco.step()  # step 1
    assert diloco.step()  # step 2: healed into the quorum's sync at step 8, applied there
    assert diloco.local_step == 8 and not diloco.engine.in_flight and diloco.records[0].fields["healed"]
    for p in diloco.global_params:  # the donor's 2.0 minus the other member's mean alone
        torch.testing.assert_close(p, torch.full_like(p, 1.75))
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), diloco.global_params, strict=True))


def test_a_worker_behind_adopts_the_quorums_state_and_contributes_nothing():
    engine, replica = engine_and_replica([])
    donor = donor_state(engine)
    other = [torch.full((2, 3), 0.25), torch.full((2,), 0.25)]
    engine.reducer.group.attempts = [{"others": flat(other, 1, 0), "commit": True, "heal": donor}]
    record = sync(engine, replica)
    assert torch.equal(engine.reducer.group.sent[0][-2:], torch.tensor([0.0, 1.0]))  # count 0, healed
    assert torch.count_nonzero(engine.reducer.group.sent[0][:-2]) == 0
    for p in engine.global_params:  # the donor's 2.0 minus the other member's mean alone
        torch.testing.assert_close(p, torch.full_like(p, 1.75))
    assert all(
        torch.equal(p, g) for p, g in zip(replica.model.parameters(), engine.global_params, strict=True)
    )
    assert engine.progress.steps == 8 and engine.progress.fragment_syncs == 5 and replica.inner_steps == 8
    assert record.fields["healed"] and record.fields["replicas_left_out"] == 0
    assert engine.reducer.membership.heals == 1


def test_a_heal_whose_state_does_not_match_its_digest_is_refused_and_the_sync_retried():
    """A state damaged in transfer is never adopted: the quorum fails like a broken transfer, and the
    worker syncs in the next one with its own state and contribution."""
    engine, replica = engine_and_replica([])
    damaged = donor_state(engine)
    damaged["tensors"][0] = damaged["tensors"][0].clone()
    damaged["tensors"][0][0, 0] = 2.5  # after the donor computed its digest
    other = [torch.full((2, 3), 0.1), torch.full((2,), 0.1)]
    engine.reducer.group.attempts = [
        {"others": None, "commit": False, "heal": damaged},
        {"others": flat(other, 1, 0), "commit": True},
    ]
    start = [p.clone() for p in engine.global_params]
    record = sync(engine, replica)
    assert engine.reducer.membership.retried_syncs == 1 and not record.fields["healed"]
    for before, after in zip(start, engine.global_params, strict=True):
        torch.testing.assert_close(after, before - (0.5 + 0.1) / 2)  # its own mean: nothing adopted


def test_a_healed_worker_joins_the_quorums_sync_of_another_fragment_at_its_step():
    # Streaming (P = 2, tau = 1): this worker planned fragment 0 at its step 2; the quorum syncs fragment 1
    # at step 6 (blocks "0." and "1." are fragments 0 and 1).
    engine, replica = engine_and_replica([], sync=SyncConfig(every=4, fragments=2, overlap=1))
    donor = donor_state(engine)
    donor["meta"].update(step=6, outer_steps=1, fragment_syncs=3, sync_fragment=1, sync_apply_step=7)
    other = [torch.full((2, 2), 0.25), torch.full((2,), 0.25)]  # fragment 1's shapes
    engine.reducer.group.attempts = [{"others": flat(other, 1, 0), "commit": True, "heal": donor}]
    with torch.no_grad():
        for p in replica.model.parameters():
            p.sub_(0.5)
    replica.inner_steps = engine.progress.steps = 2
    started = engine.start(0, [replica], 2, SumCount(0.0, 1))
    assert (started.fragment, started.started_step, started.apply_step) == (1, 6, 7)
    engine.progress.steps = replica.inner_steps = 7  # tau inner steps later (none taken here)
    record = engine.finish(started, [replica])
    sent = engine.reducer.group.sent[0]
    assert sent.numel() == 4 + 2 + 2 and torch.equal(sent, flat([torch.zeros(2, 2), torch.zeros(2)], 0, 1))
    fragment0, fragment1 = engine.global_params[:2], engine.global_params[2:]
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in fragment0)  # the donor's, untouched
    for p in fragment1:  # the donor's 2.0 minus the other member's mean alone
        torch.testing.assert_close(p, torch.full_like(p, 1.75))
    assert record.fragment == 1 and record.fields["healed"] and engine.progress.fragment_syncs == 4
    # the replicas restarted from the adopted state
    assert [f.unsynced for f in engine.fragments] == [False, False]
    # The part it joins with keeps the run's aggregation rule (a robust rule must be applied alike).
    robust = Contribution(0, 2, 1, engine.global_params, 1.0, aggregate="median", trim=2)
    joined = engine.reducer._joining(robust, 1, 6, 7)
    assert (joined.fragment, joined.step, joined.apply_step, joined.healthy) == (1, 6, 7, 0)
    assert (joined.aggregate, joined.trim, joined.messages) == ("median", 2, [])


def test_a_sync_in_flight_exchanges_in_the_background_and_a_failed_one_is_dropped():
    # tau = 1: the collectives run on the reducer's thread, the vote comes when the mean is waited for.
    attempts = [{"others": None, "commit": False}, {"others": None, "commit": False}]
    engine, replica = engine_and_replica(
        attempts, retries=1, sync=SyncConfig(every=4, fragments=2, overlap=1)
    )
    start = [p.clone() for p in engine.global_params]
    with torch.no_grad():
        for p in replica.model.parameters():
            p.sub_(0.5)
    local = [p.clone() for p in replica.model.parameters()]
    replica.inner_steps = engine.progress.steps = 4
    feedback = ErrorFeedback()
    feedback.buffers = {name: torch.ones(1) for name in ("0.weight", "1.weight")}  # fragment 0, fragment 1
    engine.error_feedback = [feedback]
    started = engine.start(0, [replica], 4, SumCount(0.0, 1))
    assert (started.fragment, started.apply_step) == (0, 5)
    engine.progress.steps = replica.inner_steps = 5
    record = engine.finish(started, [replica])
    # Dropped: no outer step, not counted, the replica keeps its drift for the fragment's next sync.
    assert all(torch.equal(a, b) for a, b in zip(start, engine.global_params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(local, replica.model.parameters(), strict=True))
    assert engine.progress.fragment_syncs == 0 and engine.fragments[0].unsynced
    assert record.fields["dropped"] and engine.reducer.membership.dropped_syncs == 1
    assert list(feedback.buffers) == ["1.weight"]  # the next sync resends fragment 0's whole drift
    # A second failure in a row is more than quorum_retries=1 allows: the run fails with one line.
    engine.progress.steps = replica.inner_steps = 6
    again = engine.start(1, [replica], 6, SumCount(0.0, 1))
    with pytest.raises(TrainingError, match="2 syncs in a row failed"):
        engine.finish(again, [replica])


def test_a_worker_with_nothing_to_contribute_joins_the_sync_and_is_not_left_out():
    # A worker that healed into the run's last step joins the later fragments' syncs with no replicas.
    other = [torch.full((2, 3), 0.1), torch.full((2,), 0.1)]
    engine, replica = engine_and_replica([{"others": flat(other, 1, 0), "commit": True}])
    replica.inner_steps = engine.progress.steps = 2
    started = engine.start(0, [], 2, SumCount(0.0, 0))
    assert torch.equal(engine.reducer.group.sent[0][-2:], torch.tensor([0.0, 1.0]))  # none, not left out
    record = engine.finish(started, [replica])
    assert record.fields["replicas_left_out"] == 0 and engine.progress.bad_syncs == 0
    assert all(
        torch.equal(p, g) for p, g in zip(replica.model.parameters(), engine.global_params, strict=True)
    )


def test_compressed_members_decode_in_quorum_order_and_a_healed_one_is_not_left_out():
    from muloco.compress import get_compressor
    from muloco.sync.codec import PseudogradientCodec

    engine, replica = engine_and_replica([])
    names = ["weight", "bias"]
    codec = PseudogradientCodec(names, [get_compressor("linear", 8, "row") for _ in names])
    healed_member = bytes([1]) + pack([])
    engine.reducer.group.attempts = [{"others": [healed_member], "commit": True}]
    contribution_messages = [codec.encode([torch.full((2, 3), 0.5), torch.full((2,), 0.5)])]

    c = Contribution(0, 2, 1, engine.global_params, 10.0, None, contribution_messages, codec)
    engine.reducer.group.form_quorum()
    mean = engine.reducer._mean_compressed(c, healed=False)
    assert mean.contributors == 1 and mean.left_out == 0
    torch.testing.assert_close(mean.values[0], torch.full((2, 3), 0.5), atol=0.01, rtol=0)


def test_a_quorum_that_never_forms_fails_the_run_after_the_retries():
    engine, replica = engine_and_replica(["no quorum", "no quorum"], retries=1)
    with pytest.raises(TrainingError, match="failed 2 times in a row"):
        sync(engine, replica)
    assert engine.reducer.membership.retried_syncs == 2


@pytest.mark.parametrize(
    "override, field",
    [
        ("sync.transport=reduce_scatter", "sync.transport=auto"),
        ("method=dp", "method: diloco"),
    ],
)
def test_what_a_torchft_worker_cannot_run_is_a_config_error(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(CONFIG, ["backend.kind=torchft", "workers=4", *override.split()])


def test_a_worker_of_several_ranks_names_its_index_and_is_a_world_of_its_own():
    from muloco.comm.topology import Topology
    from muloco.errors import UserError

    two_ranks = Topology(2, 1, 0, 1, None, object())
    with pytest.raises(UserError, match="backend.torchft.replica_id is needed with ranks_per_worker > 1"):
        ElasticReducer(TorchftBackendConfig(), workers=2, topology=two_ranks)
    reducer = ElasticReducer(TorchftBackendConfig(replica_id=1), workers=2, topology=two_ranks)
    assert reducer.local_replicas(2) == [1] and not reducer.is_lead  # rank 1: no quorums of its own
    one_world = Topology(2, 2, 0, 0, None, object())  # 4 processes in one world: two workers' ranks mixed
    with pytest.raises(UserError, match="their own MASTER_PORT"):
        ElasticReducer(TorchftBackendConfig(replica_id=0), workers=2, topology=one_world)


def test_the_launcher_wants_whole_workers_of_ranks(capsys):
    from muloco.cli import main

    args = [
        "workers=2",
        "ranks_per_worker=2",
        "model.seq_len=32",
        "train.batch_tokens=256",
        "train.micro_batch_tokens=64",
    ]
    assert main(["launch", "--nproc", "3", "--backend", "torchft", CONFIG, *args]) == 2
    assert "--nproc (3) must be a multiple of ranks_per_worker (2)" in capsys.readouterr().err
