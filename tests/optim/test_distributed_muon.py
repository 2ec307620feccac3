"""DistributedMuon: owners balanced by NS cost; R = 1, 2, 4 ranks equal single-process Muon; state per rank.

The multi-process tests start R copies of this file as a script (the `__main__` block at the end), which
join a gloo group on 127.0.0.1, step on the same seeded gradients, and save what the test compares.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
from test_helpers import run_rank_scripts

from muloco.optim import DistributedMuon, Muon, assign_owners
from muloco.optim.distributed_muon import balance, ns_flops

# Varied shapes: same-shape stacks (square, tall, wide), a conv weight (8, 36), a 2:1 one, a lone small one,
# and two weights stored (in, out) as GPT-2's Conv1D (a `transposed` group).
SHAPES = [(64, 64)] * 3 + [(128, 32)] * 2 + [(32, 128)] * 2 + [(96, 48), (8, 4, 3, 3), (16, 16)]
SHAPES += [(24, 40)] * 2
STEPS, SAVE_AT = 10, 5
D512_L6 = [(512, 512)] * 4 * 6 + [(2048, 512), (512, 2048)] * 6  # q, k, v, o and the MLP of 6 blocks
PROCESS_TIMEOUT_S = 90  # the whole R-process run; the gloo timeout inside is 30 s


def seeded(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def make_params(shapes=SHAPES):
    return [torch.nn.Parameter(seeded(shape, seed=100 + i)) for i, shape in enumerate(shapes)]


def param_groups(params):
    """Groups with different hyperparameters, so the per-group code paths are exercised; with the full
    SHAPES the last two weights are a transposed group."""
    if len(params) != len(SHAPES):
        cut = 2 * len(params) // 3
        return [
            {"params": params[:cut]},
            {"params": params[cut:], "lr": 0.01, "nesterov": False, "weight_decay": 0.0},
        ]
    cut = 2 * (len(params) - 2) // 3
    return [
        {"params": params[:cut]},
        {"params": params[cut:-2], "lr": 0.01, "nesterov": False, "weight_decay": 0.0},
        {"params": params[-2:], "transposed": True},
    ]


def set_grads(params, step):
    for i, p in enumerate(params):
        p.grad = seeded(p.shape, seed=1000 * step + i)  # the same on every rank, as after an all-reduce


def train(opt, params, steps):
    for step in steps:
        set_grads(params, step)
        opt.step()


def muon_reference(ns_dtype, shapes=SHAPES, steps=STEPS):
    params = make_params(shapes)
    opt = Muon(param_groups(params), lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    train(opt, params, range(steps))
    return [p.detach() for p in params]


# --- owner assignment (no processes) ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_d512_l6_matrices_split_evenly(world_size):
    owners = assign_owners(D512_L6, world_size)
    loads = [sum(ns_flops(s) for s, o in zip(D512_L6, owners) if o == r) for r in range(world_size)]
    assert max(loads) == min(loads)  # 24 square + 12 4:1 matrices split exactly at R = 2 and 4
    elements = [
        sum(torch.Size(s).numel() for s, o in zip(D512_L6, owners) if o == r) for r in range(world_size)
    ]
    assert max(elements) == min(elements)  # so momentum state per rank is exactly 1/R


def test_assignment_is_deterministic_largest_first_and_breaks_ties_by_index():
    assert assign_owners([(64, 64)] * 4, 2) == [0, 1, 0, 1]
    # The largest goes first, to rank 0; the next ones fill the least-loaded rank.
    assert assign_owners([(16, 16), (256, 256), (16, 16), (128, 128)], 2) == [1, 0, 1, 1]
    shapes = [tuple(seeded((2,), seed=i).abs().mul(100).int().add(8).tolist()) for i in range(40)]
    assert assign_owners(shapes, 3) == assign_owners(list(shapes), 3)
    assert assign_owners(shapes, 1) == [0] * 40
    with pytest.raises(ValueError, match="at least one"):
        assign_owners(shapes, 0)


def test_lpt_keeps_the_largest_load_within_one_item_of_the_mean():
    costs = [int(c) for c in (seeded((200,), seed=3).abs() * 1e6)]
    for bins in (2, 3, 4, 7):
        owners = balance(costs, bins)
        loads = [sum(c for c, o in zip(costs, owners) if o == b) for b in range(bins)]
        assert max(loads) <= sum(costs) / bins + max(costs)
        assert max(loads) < 1.02 * sum(costs) / bins  # many small items: LPT is nearly exact


def test_ns_cost_estimate():
    n = 512
    assert ns_flops((n, n), steps=5) == 5 * (2 * 2 * n**3 + 2 * n**3)  # 2 big + 1 small product per step
    assert ns_flops((4 * n, n), 5) == ns_flops((n, 4 * n), 5)  # the short side is what counts
    assert ns_flops((4 * n, n), 5, "gram") < ns_flops((4 * n, n), 5, "standard")
    assert ns_flops((8, 4, 3, 3), 5) == ns_flops((8, 36), 5)  # conv weights are flattened


# --- one process: DistributedMuon is Muon ------------------------------------------------------------------


def test_world_size_1_equals_muon_bitwise_in_the_default_dtype():
    expected = muon_reference(ns_dtype=None)
    params = make_params()
    opt = DistributedMuon(param_groups(params), lr=0.02, weight_decay=0.1)
    assert (opt.world_size, opt.rank) == (1, 0)
    train(opt, params, range(STEPS))
    for a, b in zip(params, expected):
        assert torch.equal(a.detach(), b)
    assert all("momentum_buffer" in opt.state[p] for p in params)
    assert opt.state_bytes() == sum(p.numel() * 4 for p in params)


def test_full_states_load_and_foreign_shards_are_refused():
    params = make_params()
    muon = Muon(param_groups(params), lr=0.02, weight_decay=0.1)
    train(muon, params, range(2))
    opt = DistributedMuon(param_groups(params), lr=0.02, weight_decay=0.1)
    opt.load_state_dict(muon.state_dict())  # a full single-process state: this rank keeps what it owns
    for p in params:
        assert torch.equal(opt.state[p]["momentum_buffer"], muon.state[p]["momentum_buffer"])
    shard = copy.deepcopy(opt.state_dict())
    shard["ownership"] = {"world_size": 2, "rank": 1, "owners": [0, 1] * 5}
    with pytest.raises(ValueError, match="same rank of the same layout"):
        opt.load_state_dict(shard)


def test_groups_cannot_be_added_after_the_first_step():
    params = make_params()
    opt = DistributedMuon(params[:3])
    train(opt, params[:3], range(1))
    with pytest.raises(ValueError, match="before the first step"):
        opt.add_param_group({"params": params[3:]})


# --- R processes on gloo -----------------------------------------------------------------------------------


def run_ranks(world_size: int, out: Path) -> None:
    """Run this file as R rank processes (tests/test_helpers.py's run_rank_scripts)."""
    run_rank_scripts(__file__, world_size, out, PROCESS_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
# Time (R = 2 ~7 s, R = 4 ~12-26 s on 2 cores): R processes on gloo, each importing torch before its step
# per ns_dtype; R = 4 runs more ranks than cores, the case a real node with one rank per GPU has.
def test_r_ranks_equal_single_process_muon(tmp_path, world_size):
    run_ranks(world_size, tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    owners = assign_owners(SHAPES, world_size)
    for ns_dtype in ("fp32", "bf16"):
        expected = muon_reference(torch.float32 if ns_dtype == "fp32" else torch.bfloat16)
        for rank, result in enumerate(results):
            got = result[ns_dtype]
            assert got["owners"] == owners
            for i, (a, b) in enumerate(zip(got["params"], expected)):
                if ns_dtype == "fp32":  # the same per-matrix maths in the same order: bitwise
                    assert torch.equal(a, b), (rank, i, (a - b).abs().max())
                else:  # a lone bf16 matrix takes another GEMM path than a stack: last-bit differences
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-3, msg=f"{rank=} {i=}")
            # Momentum lives exactly on the owner: state per rank is its share of the matrices.
            assert got["has_momentum"] == [owner == rank for owner in owners]
            mine = sum(torch.Size(s).numel() * 4 for s, o in zip(SHAPES, owners) if o == rank)
            assert got["state_bytes"] == mine
            assert got["restored_equal"], "state_dict round trip on the same rank did not restore the run"
        # Identical parameters on every rank, also in bf16.
        for result in results[1:]:
            for a, b in zip(result[ns_dtype]["params"], results[0][ns_dtype]["params"]):
                assert torch.equal(a, b)
    few = muon_reference(torch.float32, shapes=SHAPES[:2], steps=3)
    for result in results:  # fewer matrices than ranks: owners without matrices send nothing
        for a, b in zip(result["few"], few):
            assert torch.equal(a, b)
        assert result["factory"] == "DistributedMuon" and result["factory_params_equal"]


def rank_main(rank: int, world_size: int, port: int, out: Path) -> None:
    """One rank of `run_ranks`: train, check the state_dict round trip, save what the test compares."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),  # a missing rank makes the others raise instead of hanging
    )
    try:
        result = {}
        for name, ns_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            params = make_params()
            opt = DistributedMuon(param_groups(params), lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
            train(opt, params, range(SAVE_AT))
            saved = copy.deepcopy(opt.state_dict())
            at_save = [p.detach().clone() for p in params]
            train(opt, params, range(SAVE_AT, STEPS))
            restored = [torch.nn.Parameter(p.clone()) for p in at_save]
            reopt = DistributedMuon(param_groups(restored), lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
            reopt.load_state_dict(saved)
            train(reopt, restored, range(SAVE_AT, STEPS))
            result[name] = {
                "params": [p.detach() for p in params],
                "owners": opt.owners,
                "has_momentum": [p in opt.state for p in params],
                "state_bytes": opt.state_bytes(),
                "restored_equal": all(torch.equal(a, b) for a, b in zip(params, restored)),
            }
        few = make_params(SHAPES[:2])
        few_opt = DistributedMuon(param_groups(few), lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
        train(few_opt, few, range(3))
        result["few"] = [p.detach() for p in few]
        result.update(factory_check(world_size))
        torch.save(result, out / f"rank{rank}.pt")
        # Every rank done before any tears down: gloo can abort ("terminate called without an active
        # exception") when a peer closes its pairs while another still finishes its last collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def factory_check(world_size: int) -> dict:
    """build_inner_optimizer(..., process_group) on a tiny GPT: DistributedMuon, and one data-parallel step
    (each rank its own batch, gradients averaged) leaves identical parameters on every rank."""
    import torch.distributed as dist

    from muloco.config import InnerConfig
    from muloco.models import GPT, GPTConfig
    from muloco.optim import build_inner_optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    opt = build_inner_optimizer(model, InnerConfig(), process_group=dist.group.WORLD)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x, torch.roll(x, -1, dims=1)).backward()
    for p in model.parameters():  # what the worker's data-parallel all-reduce does
        dist.all_reduce(p.grad)
        p.grad /= world_size
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "factory": type(opt.optimizers[0]).__name__,
        "factory_params_equal": all(torch.equal(g, flat) for g in gathered),
    }


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
