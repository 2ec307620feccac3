"""dp.comm_hook: method dp through torch's DDP with its bf16 and PowerSGD communication hooks
(muloco/run/ddp_hooks.py). In this process: PowerSGD's state across a checkpoint and DDP's bucket layouts,
and the bytes each hook books. Over 2 processes (slow): the hooks through `muloco train`, a bitwise resume,
and PowerSGD's loss beside DDP's."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from test_helpers import run_combo_ranks, run_muloco_here

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.models import build_model
from muloco.net.launch import free_port
from muloco.run.ddp_hooks import CommHookDDP

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")
MODEL = ["model.preset=nano", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32"]


@pytest.fixture
def world_of_one():
    """A one-process gloo world in this process: DDP and its hooks run as on every rank of a larger one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def hooked_model(hook: str, start: int = 2) -> tuple[torch.nn.Module, CommHookDDP, torch.optim.Optimizer]:
    cfg = load_config(QS, [*MODEL, "method=dp", f"dp.comm_hook={hook}", f"dp.powersgd_start_step={start}"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 256)
    return model, CommHookDDP(model, cfg.dp), torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model, ddp, optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))]
        ddp.forward_backward(batches * 2, 2, torch.device("cpu"), contextlib.nullcontext)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_powersgd_resumes_bit_for_bit_though_ddp_lays_its_buckets_out_again(world_of_one):
    """A fresh DDP's first step has its first bucket layout (parameters in order), later steps the rebuilt
    one (in reverse): the state saved at step 5 must fit the resumed DDP's first layout and then its
    rebuilt one again, bit for bit with the uninterrupted run."""
    model, ddp, optimizer = hooked_model("powersgd")
    train_steps(model, ddp, optimizer, range(8))
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    final_state = ddp.state_dict()

    model, ddp, optimizer = hooked_model("powersgd")
    train_steps(model, ddp, optimizer, range(5))
    saved = ddp.state_dict(), model.state_dict(), optimizer.state_dict()
    assert saved[0]["iter"] == 5 and len(saved[0]["error"]) == len(uninterrupted)
    model, ddp, optimizer = hooked_model("powersgd")
    ddp.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    layouts, lay_out, index_of = [], ddp.by_parameter.lay_out, ddp.by_parameter.index_of
    ddp.by_parameter.lay_out = lambda bucket: [
        layouts.append(tuple(index_of[id(p)] for p in bucket.parameters())),
        lay_out(bucket),
    ]
    train_steps(model, ddp, optimizer, range(5, 8))

    for a, b in zip(model.parameters(), uninterrupted, strict=True):
        assert torch.equal(a, b)
    for key in ("error", "p", "q"):
        resumed = ddp.state_dict()[key]
        assert resumed.keys() == final_state[key].keys() and resumed  # every matrix compressed was kept
        assert all(torch.equal(resumed[i], final_state[key][i]) for i in resumed), key
    # One bucket per step at this size; DDP's rebuild after the resumed first step reversed its order.
    assert len(layouts) == 3 and layouts[0] != layouts[1] == layouts[2]


def test_the_hooks_book_the_bytes_they_send(world_of_one):
    model, ddp, optimizer = hooked_model("bf16")
    numel = sum(p.numel() for p in model.parameters())
    train_steps(model, ddp, optimizer, range(1))
    assert sum(ddp.take_payloads()) == 2 * numel  # the whole gradient once, in bf16

    model, ddp, optimizer = hooked_model("powersgd", start=3)
    state = ddp.powersgd
    sent = []
    for step in range(5):
        before = state.total_numel_after_compression
        train_steps(model, ddp, optimizer, range(step, step + 1))
        sent.append((sum(ddp.take_payloads()), state.total_numel_after_compression - before))
    assert [bytes_ for bytes_, _ in sent[:3]] == [4 * numel] * 3  # plain fp32 all-reduce until step 3
    for bytes_, elements in sent[3:]:  # then torch's own count of what it sends: uncompressed + P + Q
        assert bytes_ == 4 * elements and bytes_ < 4 * numel / 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["method=diloco", "dp.comm_hook=powersgd"], "dp.comm_hook=powersgd compresses method: dp's"),
        (["method=dp", "dp.comm_hook=powersgd", "dp.powersgd_rank=0"], "dp.powersgd_rank: Input should be"),
        (["method=dp", "dp.comm_hook=powersgd", "dp.powersgd_start_step=1"], "dp.powersgd_start_step:"),
        (["method=dp", "dp.comm_hook=bf16", "workers=2"], "launch 2 processes (muloco launch --nproc 2)"),
    ],
)
def test_bad_comm_hook_settings_are_one_line(tmp_path, overrides, message):
    result = run_muloco_here("train", QS, *TINY, *overrides, f"run.output_dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("muloco: error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not any(tmp_path.iterdir())


# --- over 2 processes --------------------------------------------------------------------------------

HOOKS = ("none", "bf16", "powersgd")


def hook_overrides(output_dir: Path, hook: str) -> list[str]:
    steps = ["train.total_tokens=16384", "checkpoint.every=4", "checkpoint.keep=10"]  # 16 steps of 1,024
    args = ["method=dp", "workers=2", "train.batch_tokens=1024", "train.micro_batch_tokens=256", *steps]
    powersgd = ["dp.powersgd_rank=1", "dp.powersgd_start_step=4"]
    return [*TINY, *args, f"dp.comm_hook={hook}", *powersgd, f"run.output_dir={output_dir}"]


# Time (~12 s alone, ~22 s in the parallel suite): three 16-step runs over 2 processes, then two of them
# again from their step-8 checkpoints.
@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory) -> Path:
    """Every hook in one go (full/), then bf16 and powersgd cut to their first 2 checkpoints (cut/) and
    resumed: one set of 2 processes (combo_rank.py) per phase."""
    directory = tmp_path_factory.mktemp("hooks")
    for phase, hooks in (("full", HOOKS), ("cut", HOOKS[1:])):
        if phase == "cut":
            for hook in hooks:
                shutil.copytree(directory / "full" / hook, directory / "cut" / hook)
                for rank_dir in ("", "rank1"):
                    for path in list_checkpoints(directory / "cut" / hook / "checkpoints" / rank_dir)[2:]:
                        path.unlink()  # keep steps 4 and 8: PowerSGD compressing since step 4
        cases = [
            {"name": hook, "overrides": hook_overrides(directory / phase, hook), "port": free_port()}
            for hook in hooks
        ]
        (directory / f"ranks-{phase}").mkdir()
        run_combo_ranks("torch", 2, cases, directory / f"ranks-{phase}", QS, timeout=300)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("hook", HOOKS[1:])
def test_a_hooked_dp_run_resumes_bit_for_bit_over_processes(hook_runs, hook):
    full, cut = hook_runs / "full" / hook, hook_runs / "cut" / hook
    log = (hook_runs / "ranks-cut" / "rank0.log").read_text()
    assert f"resumed checkpoint={cut / 'checkpoints' / 'step_00000008.pt'} step=8" in log
    for rank_dir in ("", "rank1"):
        a = load_checkpoint(list_checkpoints(full / "checkpoints" / rank_dir)[-1])
        b = load_checkpoint(list_checkpoints(cut / "checkpoints" / rank_dir)[-1])
        for x, y in zip(a["replicas"][0]["model"].values(), b["replicas"][0]["model"].values(), strict=True):
            assert torch.equal(x, y)
        if hook == "powersgd":
            for key in ("error", "p", "q"):
                assert all(
                    torch.equal(v, b["dp"]["comm_hook"][key][i]) for i, v in a["dp"]["comm_hook"][key].items()
                )


@pytest.mark.slow
def test_hooked_dp_trains_beside_ddp_and_books_fewer_bytes(hook_runs):
    summaries = {h: json.loads((hook_runs / "full" / h / "summary.json").read_text()) for h in HOOKS}
    assert all(s["status"] == "completed" for s in summaries.values())
    ddp, bf16, powersgd = (summaries[h] for h in HOOKS)
    # bf16 sends every gradient in half the bytes; PowerSGD (rank 1) from step 4 on a few percent of them.
    assert bf16["bytes_sent_per_worker"] == ddp["bytes_sent_per_worker"] / 2
    assert powersgd["bytes_sent_per_worker"] < ddp["bytes_sent_per_worker"] / 3
    # Measured: none 4.4548, bf16 4.4548, powersgd 4.4817 (+0.6%; rank 1 from step 4 of 16).
    assert bf16["final_val_loss"] == pytest.approx(ddp["final_val_loss"], rel=0.01)
    assert powersgd["final_val_loss"] == pytest.approx(ddp["final_val_loss"], rel=0.05)
