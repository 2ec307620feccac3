"""`method: dp` (dp.py): the data-parallel baseline is K-worker data parallelism."""

import copy

import torch
from test_helpers import params_of

from muloco.config import load_config
from muloco.data import ReplicaStream
from muloco.run.trainer import Trainer


class _Interleave:
    """One stream that yields micro-batch i from stream i mod K: a single worker seeing DP's data."""

    def __init__(self, streams):
        self.streams, self.calls = streams, 0

    def next_batch(self, n):
        stream = self.streams[self.calls % len(self.streams)]
        self.calls += 1
        return stream.next_batch(n)

    def state_dict(self):
        return {}


def test_dp_with_k_workers_equals_one_worker_with_the_k_times_batch(tiny):
    dp = Trainer(load_config(None, [*tiny, "method=dp", "workers=2", "train.batch_tokens=512", "run.name=a"]))
    dp.run()
    single = Trainer(
        load_config(
            None,
            [
                *tiny,
                "method=dp",
                "workers=1",
                "train.batch_tokens=512",
                "train.micro_batch_tokens=256",
                "run.name=b",
            ],
        )
    )
    single.dp.streams = [_Interleave([copy.deepcopy(s) for s in dp_streams_at_start(dp)])]
    single.run()
    for a, b in zip(params_of(dp.replicas[0].model), params_of(single.replicas[0].model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def dp_streams_at_start(trainer):
    return [
        ReplicaStream(
            trainer.data.train, trainer.cfg.model.seq_len, r, trainer.cfg.workers, trainer.cfg.run.seed
        )
        for r in range(trainer.cfg.workers)
    ]
