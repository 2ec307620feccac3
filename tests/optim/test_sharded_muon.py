"""ShardedMuon: FSDP2 models on R = 2 and 3 gloo ranks equal single-process Muon; state holds only shards.

The multi-process tests start R copies of this file as a script (the `__main__` block at the end), which
join a gloo group on 127.0.0.1, wrap the same seeded model with `fully_shard` per layer and at the root,
train it with ShardedMuon next to a plain Muon copy fed the same full gradients, and save what the test
compares.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
from test_helpers import run_rank_scripts
from torch import nn

from muloco.optim import Muon
from muloco.optim.sharded_muon import ShardedMuon, shard_rows

STEPS = 10
PROCESS_TIMEOUT_S = 90  # the whole R-process run; the gloo timeout inside is 30 s
# Random-gradient parameters: a same-shape pair, tall and wide, a conv weight, 5 rows (not divisible by
# 2 or 3) and 2 rows (fewer than 3 ranks); the last one is stored (in, out) and stepped transposed.
BANK_SHAPES = [(16, 16), (16, 16), (24, 8), (8, 24), (8, 4, 3, 3), (5, 7), (2, 10), (12, 20)]


class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in, out), as GPT-2's Conv1D: a `transposed` Muon group."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * n_in**-0.5)

    def forward(self, x):
        return x @ self.weight


class Net(nn.Module):
    """Rows 16, 16, 16, 16 (stored), 2: a same-shape pair, a transposed weight, fewer rows than 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16, bias=False)  # (16, 12)
        self.a = nn.Linear(16, 16, bias=False)  # (16, 16), stacked with b
        self.b = nn.Linear(16, 16, bias=False)
        self.proj = Conv1D(16, 10)  # stored (16, 10), stepped as (10, 16)
        self.head = nn.Linear(10, 2, bias=False)  # (2, 10)

    def layers(self):
        return [self.inp, self.a, self.b, self.proj, self.head]

    def forward(self, x):  # (B, 12) -> (B, 2)
        for layer in self.layers()[:-1]:
            x = torch.tanh(layer(x))
        return self.head(x)


class Bank(nn.Module):
    """Parameters only (no forward): stepped on seeded random gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in BANK_SHAPES)

    def layers(self):
        return []


def net_groups(net):
    """Three groups: defaults with weight decay; no Nesterov with its own lr and decay; transposed."""
    return [
        {"params": [net.inp.weight, net.a.weight, net.b.weight]},
        {"params": [net.head.weight], "lr": 0.01, "nesterov": False, "weight_decay": 0.05},
        {"params": [net.proj.weight], "transposed": True},
    ]


def bank_groups(bank):
    w = list(bank.weights)
    return [
        {"params": w[:4]},
        {"params": w[4:7], "lr": 0.01, "nesterov": False, "weight_decay": 0.0},
        {"params": w[7:], "transposed": True},
    ]


def seeded(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make(kind):
    torch.manual_seed(0)  # the same initial weights on every rank
    return Net() if kind == "net" else Bank()


def optimizer(cls, groups, ns_dtype=torch.float32):
    return cls(groups, lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)


# --- one process ---------------------------------------------------------------------------------------


def test_shard_rows_is_torch_chunk():
    for rows in range(12):
        for world_size in range(1, 6):
            chunks = [len(c) for c in torch.arange(rows).chunk(world_size)] if rows else []
            chunks += [0] * (world_size - len(chunks))
            got = [shard_rows(rows, world_size, r) for r in range(world_size)]
            assert [stop - start for start, stop in got] == chunks, (rows, world_size)
            assert got[0][0] == 0 and got[-1][1] == rows


def test_plain_parameters_are_stepped_as_muon_bitwise():
    trained = []
    for cls in (Muon, ShardedMuon):
        bank = make("bank")
        opt = cls(bank_groups(bank), lr=0.02, weight_decay=0.1)  # the default NS dtype
        for step in range(3):
            for i, p in enumerate(bank.weights):
                p.grad = seeded(p.shape, seed=1000 * step + i)
            opt.step()
        trained.append((bank, opt))
    (muon_bank, muon), (bank, opt) = trained
    assert (opt.world_size, opt.rank, opt.mesh, opt.owners) == (1, 0, None, [])
    for a, b in zip(bank.weights, muon_bank.weights):
        assert torch.equal(a, b)
    assert opt.state_bytes() == sum(p.numel() * 4 for p in bank.weights)


def test_groups_cannot_be_added_after_the_first_step():
    bank = make("bank")
    opt = ShardedMuon(list(bank.weights)[:2])
    for p in list(bank.weights)[:2]:
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(ValueError, match="before the first step"):
        opt.add_param_group({"params": list(bank.weights)[2:]})


# --- R processes on gloo -----------------------------------------------------------------------------------


def run_ranks(world_size: int, out: Path) -> list[dict]:
    """Run this file as R rank processes (tests/test_helpers.py's run_rank_scripts)."""
    run_rank_scripts(__file__, world_size, out, PROCESS_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_ranks_equal_single_process_muon(tmp_path, world_size):
    results = run_ranks(world_size, tmp_path)
    for kind in ("net", "bank"):
        for rank, result in enumerate(results):
            got = result[kind]
            for i, (a, b) in enumerate(zip(got["params"], got["expected"])):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{kind} {rank=} {i=}")
            assert got["owners"] == results[0][kind]["owners"]  # every rank computes the same owners
            assert got["state_is_sharded"], "a momentum buffer is not a DTensor laid out like its parameter"
            assert got["state_dict_restored"]
            # This rank's rows only: buffer numel == its parameter rows' numel; bytes accordingly.
            assert got["buffer_numels"] == got["local_numels"]
            assert got["state_bytes"] == 4 * sum(got["local_numels"])
        # Over the ranks the buffers cover each matrix exactly once: Muon's state, split R ways.
        full = results[0][kind]["full_numels"]
        assert [sum(r[kind]["buffer_numels"][i] for r in results) for i in range(len(full))] == full
        assert sum(r[kind]["state_bytes"] for r in results) == results[0][kind]["muon_state_bytes"]
        assert (
            max(r[kind]["state_bytes"] for r in results)
            < 1.5 * results[0][kind]["muon_state_bytes"] / world_size
        )
    assert set(results[0]["owners_used"]) == set(range(world_size))  # every rank owns some matrix
    for result in results:
        assert result["rejects_replicated"]
        if world_size == 2:  # a DTensor on a mesh of one rank: no collectives, Muon's arithmetic
            for a, b in zip(result["mesh_of_one"], result["mesh_of_one_expected"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            # bf16: an owner's stack of fewer matrices than Muon's may take another GEMM path (last bits).
            for a, b in zip(result["bf16"], result["bf16_expected"]):
                torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


def train(kind, model, groups, mesh, rank, ns_dtype=torch.float32):
    """ShardedMuon on the FSDP2 model and Muon on a plain copy, fed the same full gradients, STEPS steps."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    reference = copy.deepcopy(model)
    for layer in model.layers():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(ShardedMuon, groups(model), ns_dtype)
    muon = optimizer(Muon, groups(reference), ns_dtype)
    pairs = list(zip(model.parameters(), reference.parameters()))
    for step in range(STEPS):
        if kind == "net":  # each rank its own batch; FSDP2 reduce-scatters the mean gradient
            x = seeded((4, 12), seed=100 * step + rank)
            model(x).square().mean().backward()
        else:
            for i, (p, _) in enumerate(pairs):
                p.grad = distribute_tensor(seeded(p.shape, seed=1000 * step + i), mesh, [Shard(0)])
        for p, q in pairs:
            q.grad = p.grad.full_tensor()  # collective: every rank, same order
        opt.step()
        muon.step()
        opt.zero_grad()
    return model, reference, opt, muon


def report(kind, mesh, rank):
    from torch.distributed.tensor import DTensor

    groups = net_groups if kind == "net" else bank_groups
    model, reference, opt, muon = train(kind, make(kind), groups, mesh, rank)
    params = list(model.parameters())
    buffers = [opt.state[p]["momentum_buffer"] for p in params]
    restored = optimizer(ShardedMuon, groups(model))  # a state_dict round trip on the same layout
    restored.load_state_dict(copy.deepcopy(opt.state_dict()))
    return {
        "params": [p.full_tensor() for p in params],  # collective
        "expected": [q.detach() for q in reference.parameters()],
        "owners": opt.owners,
        "state_is_sharded": all(
            isinstance(b, DTensor) and b.placements == p.placements and b.shape == p.shape
            for p, b in zip(params, buffers)
        ),
        "state_dict_restored": all(
            isinstance(restored.state[p]["momentum_buffer"], DTensor)
            and torch.equal(restored.state[p]["momentum_buffer"].to_local(), b.to_local())
            for p, b in zip(params, buffers)
        ),
        "local_numels": [p.to_local().numel() for p in params],
        "buffer_numels": [b.to_local().numel() for b in buffers],
        "full_numels": [p.numel() for p in params],
        "state_bytes": opt.state_bytes(),
        "muon_state_bytes": sum(b.numel() * 4 for s in muon.state.values() for b in s.values()),
    }


def rank_main(rank: int, world_size: int, port: int, out: Path) -> None:
    """One rank of `run_ranks`: train both models, a mesh of one, a bad placement; save the results."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),  # a missing rank makes the others raise instead of hanging
    )
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        result = {kind: report(kind, mesh, rank) for kind in ("net", "bank")}
        result["owners_used"] = result["net"]["owners"] + result["bank"]["owners"]
        replicated = nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Replicate()]))
        try:
            ShardedMuon([replicated])
            result["rejects_replicated"] = False
        except ValueError as e:
            result["rejects_replicated"] = "Shard(0)" in str(e)
        if world_size == 2:
            # Subgroups are created by every rank in the same order; each rank keeps its own.
            alone = [dist.new_group([r]) for r in range(world_size)][rank]
            one = DeviceMesh.from_group(alone, "cpu")
            model, reference, opt, _ = train("bank", make("bank"), bank_groups, one, rank=0)
            assert (opt.world_size, opt.rank) == (1, 0), f"{opt.world_size=} {opt.rank=}"
            result["mesh_of_one"] = [p.full_tensor() for p in model.parameters()]
            result["mesh_of_one_expected"] = [q.detach() for q in reference.parameters()]
            # bf16 Newton-Schulz: O crosses the second all_to_all in bf16, the U's in fp32.
            model, reference, _, _ = train("bank", make("bank"), bank_groups, mesh, rank, torch.bfloat16)
            result["bf16"] = [p.full_tensor() for p in model.parameters()]
            result["bf16_expected"] = [q.detach() for q in reference.parameters()]
        torch.save(result, out / f"rank{rank}.pt")
        # Every rank done before any tears down: gloo can abort when a peer closes its pairs while another
        # still finishes its last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
