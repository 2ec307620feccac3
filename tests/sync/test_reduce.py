"""The reducer protocol's collective implementation (sync/reduce.py) and the engine driving a fake reducer."""

import time

import torch

from muloco.comm import CompletedHandle, LocalBackend, ring_allgather_bytes, ring_allreduce_bytes
from muloco.compress import get_compressor
from muloco.config import OuterConfig, SyncConfig
from muloco.run.replica import Replica
from muloco.sync import CollectiveReducer, Contribution, Mean, PendingMean, SyncEngine
from muloco.sync.codec import PseudogradientCodec


class OtherProcessAdds:
    """A 2-process world seen from rank 0: the other process contributes `other` (and its count)."""

    rank, world_size = 0, 2

    def __init__(self, other: list[torch.Tensor]) -> None:
        self.other = other

    def all_reduce_sum(self, tensors):
        for t, o in zip(tensors, self.other, strict=True):
            t.add_(o)
        return CompletedHandle(tensors)


def test_uncompressed_mean_over_processes_counts_the_contributors():
    backend = OtherProcessAdds([torch.full((3,), 6.0), torch.tensor([1.0])])  # one replica: 6s
    reducer = CollectiveReducer.over(backend, workers=4)
    like = [torch.zeros(3)]
    mine = Contribution(0, 0, healthy=2, like=like, payload_bytes=12.0, delta_sum=[torch.full((3,), 3.0)])
    pending = reducer.start_mean(mine)
    assert pending.bytes_sent == ring_allreduce_bytes(12.0, 4)  # known at the start
    mean = pending.wait()
    assert torch.equal(mean.values[0], torch.full((3,), 3.0))  # (3 + 6) / 3 contributors
    assert (mean.contributors, mean.left_out) == (3, 1)


def test_compressed_mean_decodes_every_message_in_replica_order():
    codec = PseudogradientCodec(["w"], [get_compressor("linear", bits=8)])
    reducer = CollectiveReducer.over(LocalBackend(), workers=2)
    deltas = [torch.randn(4, 8), torch.randn(4, 8)]
    messages = [codec.encode([d]) for d in deltas]
    like = [torch.zeros(4, 8)]
    contribution = Contribution(0, 0, 2, like, float(len(messages[0])), None, messages, codec)
    pending = reducer.start_mean(contribution)
    mean = pending.wait()
    expected = [torch.zeros(4, 8)]
    for m in messages:
        codec.decode_sum(m, expected)
    assert torch.equal(mean.values[0], expected[0] / 2)
    assert pending.bytes_sent == ring_allgather_bytes(len(messages[0]), 2) and mean.left_out == 0


def test_a_malformed_message_is_left_out_of_the_all_gather_mean_and_logged(caplog):
    codec = PseudogradientCodec(["w"], [get_compressor("linear", bits=8)])
    reducer = CollectiveReducer.over(LocalBackend(), workers=3)
    deltas = [torch.randn(4, 8) for _ in range(3)]
    messages = [codec.encode([d]) for d in deltas]
    messages[1] = messages[1][:-5]  # cut short: its payload's CRC and sizes no longer add up
    contribution = Contribution(0, 0, 3, [torch.zeros(4, 8)], float(len(messages[0])), None, messages, codec)
    with caplog.at_level("WARNING", logger="muloco"):
        mean = reducer.start_mean(contribution).wait()
    expected = [torch.zeros(4, 8)]
    for m in (messages[0], messages[2]):
        codec.decode_sum(m, expected)
    assert torch.equal(mean.values[0], expected[0] / 2)
    assert (mean.contributors, mean.left_out) == (2, 1)
    assert "message=1: left out of the mean" in caplog.text


class RecordingReducer:
    """A fake reducer: the mean is what it was given, completed at once; it records the protocol calls."""

    workers = 1
    transports = ("all_gather",)

    def __init__(self):
        self.calls = []

    def local_replicas(self, workers):
        return [0]

    def open(self, shapes, codecs):
        self.calls.append(("open", [len(s) for s in shapes]))

    def join(self, state, replicas, resumed):
        self.calls.append(("join", resumed))

    def start_mean(self, c):
        self.calls.append(("start", c.fragment, c.step, c.healthy))
        values = [t.clone() for t in c.delta_sum]
        return PendingMean.completed(Mean(values, c.healthy, 1 - c.healthy, bytes_sent=7.0))

    def after_sync(self, state, mean, replicas):
        self.calls.append(("after", state.fragment_syncs))

    def close(self):
        self.calls.append(("close",))


def test_the_engine_speaks_only_the_reducer_protocol():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    replica = Replica(0, model, torch.optim.SGD(model.parameters(), lr=0.1), None, torch.device("cpu"))
    reducer = RecordingReducer()
    engine = SyncEngine(
        model,
        reducer,
        sync=SyncConfig(every=4, fragments=2, overlap=1),
        outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False),
        compression=None,
        local_replicas=1,
        max_bad_syncs=3,
    )
    engine.join([replica], resumed=False)
    theta = [p.clone() for p in engine.global_params]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert engine.round(2, [replica]) == []  # fragment 1 starts at step 2, applied tau = 1 step later
    (sync,) = engine.in_flight
    assert (sync.fragment, sync.apply_step) == (1, 3) and engine.next_event(2) == 3
    (record,) = engine.round(3, [replica])
    # outer lr 1, no momentum: the fragment's global parameters move to the replica's.
    for i in engine.fragments[1].indices:
        assert torch.equal(engine.global_params[i], theta[i] + 1.0)
    assert record.fields["replicas_left_out"] == 0 and engine.ledger.bytes_sent == 7.0
    engine.close()
    assert reducer.calls == [("open", [2, 2]), ("join", False), ("start", 1, 2, 1), ("after", 1), ("close",)]


def test_a_reducer_that_exchanges_before_returning_books_the_wait():
    """torchft's reducer returns a sync applied at once only after its collectives: the time the training
    loop is blocked there is communication wait (summary.json's comm_wait_s), not compute."""

    class BlockingReducer(RecordingReducer):
        def start_mean(self, c):
            time.sleep(0.05)
            return super().start_mean(c)

    model = torch.nn.Linear(4, 4)
    replica = Replica(0, model, torch.optim.SGD(model.parameters(), lr=0.1), None, torch.device("cpu"))
    engine = SyncEngine(
        model,
        BlockingReducer(),
        sync=SyncConfig(every=2),
        outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False),
        compression=None,
        local_replicas=1,
        max_bad_syncs=3,
    )
    engine.join([replica], resumed=False)
    engine.round(2, [replica])
    assert engine.ledger.comm_wait_s >= 0.05
    engine.close()
