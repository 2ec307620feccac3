"""Pieces of sharded workers (muloco/sharding.py) that need no processes; the runs:
comm/test_sharded.py."""

from torch import nn

from muloco.config import load_config
from muloco.sharding import blocks, layout_free_fingerprint


def test_fsdp_wraps_the_outermost_blocks_only():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))  # stays in its block's unit

    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    model.heads = nn.ModuleList([nn.Linear(2, 2)])
    assert blocks(model) == [model.layers[0], model.layers[1], model.heads[0]]
    assert blocks(nn.Linear(2, 2)) == []  # no repeated blocks: the root alone


def test_a_sharded_checkpoint_fits_any_ranks_per_worker_but_not_another_run(TINY):
    def fingerprint(*overrides: str) -> str:
        return layout_free_fingerprint(load_config(None, [*TINY, "backend.kind=torch", *overrides]))

    base = fingerprint("sharding=fsdp", "ranks_per_worker=1", "train.micro_batch_tokens=128")
    assert fingerprint("sharding=fsdp", "ranks_per_worker=2", "train.micro_batch_tokens=128") == base
    assert fingerprint("sharding=fsdp", "workers=2") != base
    plain = load_config(None, [*TINY, "backend.kind=torch"])
    assert plain.fingerprint() != plain.fingerprint(with_layout=False)
