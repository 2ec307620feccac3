"""sync.transport is chosen among what the reducer carries (issue 40: `auto` picked reduce_scatter for
hivemind and torchft reducers, which cannot run partitioned codecs, and the run crashed at its first sync)."""

import pytest
import torch

from muloco.comm import LocalBackend
from muloco.config import CompressionConfig, OuterConfig, SyncConfig
from muloco.errors import UserError
from muloco.models import build_model
from muloco.sync.elastic import ElasticReducer
from muloco.sync.engine import SyncEngine
from muloco.sync.reduce import CollectiveReducer
from muloco.sync.swarm import SwarmReducer
from muloco.sync.transport import choose_transport

BIG = 5e6  # bytes of a message and of an owners' mean: reduce_scatter sends fewer at K = 3


def test_auto_picks_only_among_the_reducers_transports():
    assert choose_transport("auto", 3, True, None, BIG, BIG) == "reduce_scatter"
    # Overlapped with the inner steps (streaming tau > 0): one collective, all of it under the compute.
    assert choose_transport("auto", 3, True, None, BIG, BIG, overlapped=True) == "all_gather"
    assert choose_transport("reduce_scatter", 3, True, None, BIG, BIG, overlapped=True) == "reduce_scatter"
    assert choose_transport("auto", 3, True, None, BIG, BIG, ("all_gather",)) == "all_gather"
    assert choose_transport("auto", 8, True, None, BIG, BIG, ("all_gather",)) == "all_gather"
    assert choose_transport("auto", 3, False, None, BIG, BIG, ("all_gather",)) == "all_reduce"


def test_an_explicit_transport_the_reducer_cannot_carry_is_a_user_error():
    with pytest.raises(UserError, match="sync.transport=reduce_scatter needs .* use sync.transport=auto"):
        choose_transport("reduce_scatter", 3, True, None, BIG, BIG, ("all_gather",))
    assert choose_transport("all_gather", 3, True, None, BIG, BIG, ("all_gather",)) == "all_gather"


def test_each_reducer_declares_what_it_carries():
    assert "reduce_scatter" in CollectiveReducer.transports
    assert SwarmReducer.transports == ("all_gather",)  # groups change every sync: no fixed part owners
    assert ElasticReducer.transports == ("all_gather",)


class ThreeWorkers:
    """A reducer of K = 3 that declares nothing: a user's own, given to the Python API."""

    workers = 3

    def open(self, shapes, codecs):
        pass


def engine_over(reducer) -> SyncEngine:
    from muloco.config import ModelConfig

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="nano", d_model=64, n_layers=2, n_heads=2, seq_len=32), 64)
    compression = CompressionConfig(scheme="statistical", bits=4)
    return SyncEngine(
        model, reducer, sync=SyncConfig(every=3), outer=OuterConfig(), compression=compression,
        local_replicas=1, max_bad_syncs=3,
    )  # fmt: skip


def test_the_engine_takes_reduce_scatter_only_where_the_reducer_carries_it():
    collective = CollectiveReducer.over(LocalBackend(), workers=3)
    assert engine_over(collective).transport == "reduce_scatter"
    assert engine_over(ThreeWorkers()).transport == "all_gather"
