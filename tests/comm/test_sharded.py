"""Sharded workers (sharding=fsdp, docs/topology.md): FSDP2 inside each worker of R ranks equals the same
run with replicated ranks, holds 1/R of the state per rank, and checkpoints with DCP (resume bitwise, with
another R, after a kill -9)."""

import json
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY
from test_helpers import (
    assert_equal_up_to_rounding,
    launched_ranks,
    run_combo_ranks,
    run_muloco,
    run_muloco_here,
    start_muloco,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.checkpoint.sharded import list_sharded
from muloco.net.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")


def sharded_state(run_dir: Path, step: int | None = None) -> dict:
    """A sharded checkpoint's tensors, whole, by key (the newest one, or the one of `step`)."""
    checkpoints = list_sharded(run_dir / "checkpoints" / "sharded")
    path = checkpoints[-1] if step is None else next(p for p in checkpoints if p.name.endswith(f"{step:08d}"))
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=False)


def sharded_global_params(run_dir: Path, workers: int = 2) -> list[list[torch.Tensor]]:
    """Each replica's copy of the global parameters (every worker holds one)."""
    state = sharded_state(run_dir)
    return [
        [v for k, v in state.items() if k.startswith(f"replica{r}/engine/outer/params/")]
        for r in range(workers)
    ]


def common(tmp_path: Path, TINY, total_tokens: int = 9216) -> list[str]:
    return [
        *TINY,
        "workers=2",
        "train.batch_tokens=1024",
        "train.micro_batch_tokens=128",  # 4 micro-batches per worker step, 2 per rank
        f"train.total_tokens={total_tokens}",
        "backend.kind=torch",
        "backend.torch.timeout_s=60",
        f"run.output_dir={tmp_path}",
    ]


def launch(nproc: int, *overrides: str, timeout: float = 300):
    result = run_muloco("launch", "--nproc", nproc, QS, *overrides, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# Each case's overrides beside the common ones.
SHARDING_CASES = {
    "adamw": ["inner.optimizer=adamw"],
    # Sharded Muon (fp32 Newton-Schulz), 4-bit row-wise messages with error feedback per shard, and
    # streaming (2 fragments, each applied tau = 1 step after it starts). Bitwise-equal gradients, as
    # rounding to 16 levels turns a last-bit difference into a whole step: no clipping (its norm
    # summed over shards rounds otherwise than over whole tensors) and one micro-batch per rank (a
    # sharded rank reduce-scatters every micro-batch's gradients, a replicated one sums them first).
    "muon-4bit-ef-streaming": [
        "inner.ns_dtype=fp32",
        "compression.scheme=linear",
        "compression.bits=4",
        "compression.error_feedback=true",
        "train.grad_clip=0",
        "train.micro_batch_tokens=256",  # one micro-batch per rank: each gradient summed once
        "sync.every=4",
        "sync.fragments=2",
        "sync.overlap=1",
    ],
}


@pytest.fixture(scope="module")
def sharding_runs(tmp_path_factory) -> Path:
    """Every case with replicated and with sharded ranks (K = 2 workers x R = 2), in one set of 4 processes
    (combo_rank.py, wired as `muloco launch` wires them): torch starts once, not 4 times."""
    directory = tmp_path_factory.mktemp("sharding")
    cases = []
    for name, extra in SHARDING_CASES.items():
        args = [*common(directory, TINY), *extra, "ranks_per_worker=2"]
        cases.append({"name": f"{name}-replicate", "overrides": args, "port": free_port()})
        cases.append({"name": f"{name}-fsdp", "overrides": [*args, "sharding=fsdp"], "port": free_port()})
    (directory / "ranks").mkdir()
    run_combo_ranks("torch", 4, cases, directory / "ranks", QS, timeout=420)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SHARDING_CASES))
def test_fsdp_workers_equal_replicated_workers(sharding_runs, case):
    """K = 2 workers x R = 2 ranks, 3 outer steps: the same global parameters either way (to rounding:
    test_helpers.ROUNDING_REL), and each rank of a sharded worker holds and sends about half of what a
    replicated lead does."""
    extra = SHARDING_CASES[case]
    replicate, sharded = sharding_runs / f"{case}-replicate", sharding_runs / f"{case}-fsdp"
    replicated = load_checkpoint(list_checkpoints(replicate / "checkpoints")[-1])
    expected = replicated["engine"]["outer"]["params"]
    for copy in sharded_global_params(sharded):
        for a, b in zip(expected, copy, strict=True):
            assert_equal_up_to_rounding(b, a)
    fsdp = json.loads((sharded / "summary.json").read_text())
    rep = json.loads((replicate / "summary.json").read_text())
    assert fsdp["sharding"] == "fsdp" and fsdp["outer_steps"] == rep["outer_steps"] >= 3
    assert fsdp["final_val_loss"] == pytest.approx(rep["final_val_loss"], rel=1e-5)
    # The worker sends what a replicated lead sends (compressed: plus a header per shard's message) ...
    assert fsdp["bytes_sent_per_worker"] == pytest.approx(rep["bytes_sent_per_worker"], rel=0.05)
    # ... and rank 0 about half of it (it holds ceil(rows / 2) of every parameter).
    assert 0.45 < fsdp["bytes_sent_by_rank0"] / rep["bytes_sent_by_rank0"] < 0.56
    # Each rank holds only its rows of the parameters, the inner and the outer optimizer state (Muon's
    # momentum is split by owner rank when replicated already: the AdamW case compares all of it).
    parts = ("parameters", "outer", *(["optimizer"] if "inner.optimizer=adamw" in extra else []))
    for part in parts:
        ratio = fsdp["state_bytes_rank0"][part] / rep["state_bytes_rank0"][part]
        assert 0.45 < ratio < 0.56, (part, ratio)


@pytest.mark.slow
# Time (~45 s): five launches (the reference, the killed run, its resume, the refused other sharding, the
# R = 1 resume), four of 4 processes; each is a claim of its own and needs its own processes.
def test_sharded_checkpoints_resume_bitwise_after_a_kill_and_with_fewer_ranks(tmp_path, TINY):
    """A: the reference run. D: the same run, one rank SIGKILLed after its second checkpoint, then
    resumed (auto): the newest complete checkpoint, and the end bitwise A's. C: A's step-6 checkpoint
    resumed with R = 1 (2 processes): every tensor of the state equal to A's one outer step later."""
    args = [
        *common(tmp_path, TINY, total_tokens=1024 * 18),
        "inner.ns_dtype=fp32",
        "sharding=fsdp",
        "checkpoint.every=1",
    ]
    launch(4, *args, "ranks_per_worker=2", "checkpoint.keep=20", "run.name=A")

    victim_run = [*args, "ranks_per_worker=2", "checkpoint.keep=2", "run.name=D"]
    launcher = start_muloco("launch", "--nproc", 4, QS, *victim_run)
    try:
        checkpoints = tmp_path / "D" / "checkpoints" / "sharded"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(list_sharded(checkpoints)) < 2:
            time.sleep(0.02)
        launched_ranks(launcher)[1].kill()
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert launcher.returncode != 0, "the run finished before the kill"
    resumed_from = list_sharded(checkpoints)[-1]
    result = launch(4, *victim_run)
    assert f"resumed checkpoint={resumed_from}" in result.stderr
    reference, resumed = sharded_state(tmp_path / "A"), sharded_state(tmp_path / "D")
    tensors = [
        k for k, v in reference.items() if torch.is_tensor(v) and "/rng/" not in k and "skeleton" not in k
    ]
    assert len(tensors) > 100
    for key in tensors:
        assert torch.equal(reference[key], resumed[key]), key

    # The same run directory with the other sharding refuses to start over beside its checkpoints.
    other = run_muloco("launch", "--nproc", 4, QS, *victim_run, "sharding=replicate", timeout=120)
    assert other.returncode == 2 and "holds checkpoints of sharding=fsdp" in other.stderr

    step6 = next(p for p in list_sharded(tmp_path / "A" / "checkpoints" / "sharded") if p.name.endswith("06"))
    fewer = [*args, "ranks_per_worker=1", "checkpoint.keep=20", f"checkpoint.resume={step6}", "run.name=C"]
    result = launch(2, *fewer)
    assert "resumed checkpoint=" in result.stderr and "step=6" in result.stderr
    # One outer step after the resume: R = 1 sums each gradient in another order, so equal to rounding
    # (further on, training amplifies such differences as it does any).
    after_one, expected = sharded_state(tmp_path / "C", step=9), sharded_state(tmp_path / "A", step=9)
    for key in tensors:
        assert_equal_up_to_rounding(after_one[key], expected[key])


@pytest.mark.slow
def test_a_sharded_worker_hosts_one_replica(tmp_path, TINY):
    args = [*common(tmp_path, TINY), "workers=4", "ranks_per_worker=2", "sharding=fsdp"]
    result = run_muloco("launch", "--nproc", 4, QS, *args, timeout=120)
    assert result.returncode == 2
    assert "sharding=fsdp runs one replica per worker" in result.stderr


@pytest.mark.parametrize(
    "bad, message",
    [
        (["method=dp"], "method: dp"),
        (["backend.kind=local"], "backend.kind=local"),
        (["backend.kind=torch", "sync.transport=reduce_scatter"], "sync.transport=reduce_scatter"),
        (["backend.kind=torch", "model.compile=true"], "model.compile=true"),
        (["backend.kind=torch", "outer.offload=cpu"], "outer.offload=cpu"),
    ],
)
def test_unsupported_sharded_layouts_exit_2_with_one_line(tmp_path, TINY, bad, message):
    result = run_muloco_here("train", QS, *TINY, f"run.output_dir={tmp_path}", "sharding=fsdp", *bad)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sharding=fsdp does not run with" in lines[0] and message in lines[0]
