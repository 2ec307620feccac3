"""Streaming DiLoCo's fragments and their staggered schedule (sync/fragments.py; arXiv:2501.18512)."""

import pytest

from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.sync.fragments import SyncSchedule, assign_fragments, block_index

GPT_NAMES = [
    "tok_emb.weight",
    "pos_emb.weight",
    *[f"blocks.{i}.{part}" for i in range(6) for part in ("attn.qkv.weight", "mlp.fc.weight")],
    "final_norm.weight",
    "head.weight",
]


def test_block_index_reads_the_first_numeric_component():
    assert block_index("blocks.12.attn.qkv.weight") == 12
    assert block_index("model.layers.3.mlp.weight") == 3
    assert block_index("tok_emb.weight") is None


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("fragments", [1, 2, 3, 6])
def test_fragments_partition_the_parameters(pattern, fragments):
    owner = assign_fragments(GPT_NAMES, fragments, pattern)
    assert len(owner) == len(GPT_NAMES)  # every parameter in exactly one fragment
    assert set(owner) == set(range(fragments))  # and no fragment empty
    assert owner[0] == owner[1] == 0  # embeddings: first fragment
    assert owner[-1] == owner[-2] == fragments - 1  # final norm + head: last fragment


def test_strided_and_sequential_place_blocks_as_documented():
    def blocks_of(owner):
        return {b: owner[GPT_NAMES.index(f"blocks.{b}.mlp.fc.weight")] for b in range(6)}

    assert blocks_of(assign_fragments(GPT_NAMES, 3, "strided")) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert blocks_of(assign_fragments(GPT_NAMES, 3, "sequential")) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    moved = assign_fragments(GPT_NAMES, 3, "strided", embedding_fragment=-1, head_fragment=0)
    assert moved[0] == 2 and moved[-1] == 0


def test_more_fragments_than_blocks_is_refused():
    with pytest.raises(ValueError, match="sync.fragments \\(7\\) exceeds the model's 6 blocks"):
        assign_fragments(GPT_NAMES, 7)


def test_schedule_for_p3_h30_is_the_documented_one():
    schedule = SyncSchedule(every=30, fragments=3, overlap=2)
    starts = [(s, p) for s, p, _ in schedule.table(90)]
    # docs/streaming.md: fragment 0 at 30, 60, 90; fragment 1 at 10, 40, 70; fragment 2 at 20, 50, 80.
    assert starts == [(10, 1), (20, 2), (30, 0), (40, 1), (50, 2), (60, 0), (70, 1), (80, 2), (90, 0)]
    assert all(apply == start + 2 for start, _, apply in schedule.table(90))
    assert SyncSchedule(every=30).table(90) == [(30, 0, 30), (60, 0, 60), (90, 0, 90)]


@pytest.mark.parametrize(
    "override, message",
    [
        ("sync.fragments=31", "sync.fragments (31) exceeds sync.every (30)"),
        ("sync.overlap=11", "sync.overlap (11) must be at most sync.every / sync.fragments (30/3)"),
        ("sync.embedding_fragment=3", "sync.embedding_fragment (3) must be in"),
    ],
)
def test_impossible_streaming_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, ["sync.every=30", "sync.fragments=3", override])


def test_streaming_with_dp_is_refused():
    with pytest.raises(ConfigError, match="apply to method: diloco"):
        load_config(None, ["method=dp", "sync.fragments=2"])
