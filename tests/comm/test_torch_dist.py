"""torch.distributed backend (gloo, loopback): simulation == processes, the launcher's failure handling."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import TINY
from test_helpers import launch_and_interrupt, launched_ranks, run_combo_ranks, run_muloco, start_muloco

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.net.launch import free_port
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")
pytestmark = pytest.mark.slow


def launch(nproc, overrides, timeout=180):
    return run_muloco("launch", "--nproc", nproc, QS, *overrides, timeout=timeout)


def sync_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if r["kind"] == "sync"]


def final_global_params(run_dir: Path, rank_dir: str = ""):
    state = load_checkpoint(list_checkpoints(run_dir / "checkpoints" / rank_dir)[-1])
    return state["engine"]["outer"]["params"]


def simulated(overrides: list[str]) -> Trainer:
    """The one-process run of `overrides`, finished."""
    sim = Trainer(load_config(QS, [*overrides, "run.name=sim"]))
    sim.run()
    return sim


def assert_close_params(expected, got, rtol: float) -> None:
    """Bitwise when rtol is 0, else each tensor within rtol of its norm (as SIMULATION_CASES)."""
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        if rtol == 0:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            assert (a - b).norm() <= rtol * b.norm(), ((a - b).norm() / b.norm()).item()


STAT4_EF = ["compression.scheme=statistical", "compression.bits=4", "compression.error_feedback=true"]
STAT4_EF_RS = [*STAT4_EF, "sync.transport=reduce_scatter"]


# Each case's overrides and its tolerance against the simulation: 0 is bitwise, else the largest
# ||processes - simulation|| / ||simulation|| of a tensor (relative to its norm, not per element: an
# element near zero says nothing).
SIMULATION_CASES = {
    # fp32 all-reduce: gloo sums (d0 + d1) + (d2 + d3), the simulation ((d0 + d1) + d2) + d3: one
    # rounding (6e-8) per sync apart; measured 4e-8 of the norm after 4 outer steps.
    "adamw-fp32": (["inner.optimizer=adamw"], 1e-6),
    # Muon with fp32 Newton-Schulz, whose 5 iterations amplify that rounding: measured 8e-7 of the norm
    # (LayerNorm, 4 processes). A wrong sum is ~1e-2 off. (In bf16, the default on this CPU, the rounding
    # flips bf16 roundings and grows to ~1e-2 relative after the next round.)
    "muon-fp32": (["inner.optimizer=muon", "inner.ns_dtype=fp32"], 1e-5),
    # Compressed: every process decodes every replica's payload in replica order, as the simulation.
    "muon-statistical4-ef": (["inner.optimizer=muon", *STAT4_EF, "sync.transport=all_gather"], 0.0),
    # Reduce-scatter: the owners' means are all-gathered and decoded by every process.
    "muon-statistical4-ef-reduce-scatter": (["inner.optimizer=muon", *STAT4_EF_RS], 0.0),
}


WHOLE_WINDOW = ["sync.fragments=1", "sync.overlap=4", "sync.alpha=0"]
STREAMING_CASES = {
    "streaming-adamw-fp32": (["inner.optimizer=adamw"], 1e-6),
    "streaming-muon-statistical4-ef": (["inner.ns_dtype=fp32", *STAT4_EF], 0.0),
    "streaming-muon-statistical4-ef-reduce-scatter": (["inner.ns_dtype=fp32", *STAT4_EF_RS], 0.0),
    # A whole window overlapped (tau = H): two syncs in flight at each start, their collectives in order.
    "whole-window-muon-statistical4-ef": (["inner.ns_dtype=fp32", *STAT4_EF, *WHOLE_WINDOW], 0.0),
    "whole-window-muon-statistical4-ef-reduce-scatter": (
        ["inner.ns_dtype=fp32", *STAT4_EF_RS, *WHOLE_WINDOW],
        0.0,
    ),
    "eager-whole-window-muon-statistical4-ef": (
        ["inner.ns_dtype=fp32", *STAT4_EF, *WHOLE_WINDOW, "sync.eager=true"],
        0.0,
    ),
}


# Workers of different speeds (run/pacing.py), over 4 processes: at H = 3 and speeds 1, 0.5, 1, 0.25 each
# round takes 3, 1, 3 and 1 inner steps (a process with one worker sleeps its emulated speed's difference).
SPEED4 = ["train.speed=[1.0, 0.5, 1.0, 0.25]", "sync.pacing=by_speed", "sync.pacing_speeds=declared"]
PACING_CASES = {
    "by-speed-muon-statistical4-ef": (
        ["inner.ns_dtype=fp32", *STAT4_EF, "sync.transport=all_gather", *SPEED4],
        0.0,
    ),
    "by-speed-weighted-adamw-fp32": (["inner.optimizer=adamw", *SPEED4, "sync.weight_by_tokens=true"], 1e-6),
}


def streaming_common(output_dir: Path, extra: list[str]) -> list[str]:
    K2 = ["workers=2", "train.batch_tokens=512", "train.total_tokens=7168"]
    streaming = ["sync.every=4", "sync.fragments=2", "sync.overlap=1", "sync.alpha=0.5"]
    return [*TINY, *K2, *streaming, *extra, f"run.output_dir={output_dir}"]


def simulation_common(output_dir: Path, extra: list[str]) -> list[str]:
    K4 = ["method=diloco", "workers=4", "train.batch_tokens=512", "train.total_tokens=3072", "sync.every=3"]
    return [*TINY, *extra, *K4, f"run.output_dir={output_dir}"]


@pytest.fixture(scope="module")
def process_runs(tmp_path_factory) -> Path:
    """Every SIMULATION_CASES case over 4 processes (4 x 1 replica) and over 2 (2 x 2), and every
    STREAMING_CASES case over 2, in one set of processes per world size (combo_rank.py, wired as `muloco
    launch` wires them): torch starts twice, not 11 times."""
    directory = tmp_path_factory.mktemp("processes")
    for nproc in (4, 2):
        overrides = {name: simulation_common(directory, x) for name, (x, _) in SIMULATION_CASES.items()}
        if nproc == 2:
            overrides |= {name: streaming_common(directory, x) for name, (x, _) in STREAMING_CASES.items()}
        else:
            overrides |= {name: simulation_common(directory, x) for name, (x, _) in PACING_CASES.items()}
            overrides["by-speed-measured"] = simulation_common(
                directory, [*SPEED4[:2], "inner.optimizer=adamw"]
            )
        cases = [{"name": f"{n}-p{nproc}", "overrides": o, "port": free_port()} for n, o in overrides.items()]
        (directory / f"ranks{nproc}").mkdir()
        run_combo_ranks("torch", nproc, cases, directory / f"ranks{nproc}", QS, timeout=300)
    return directory


@pytest.mark.parametrize("case", list(SIMULATION_CASES))
def test_simulation_equals_4x1_and_2x2_processes(tmp_path, process_runs, case):
    extra, rtol = SIMULATION_CASES[case]
    sim = Trainer(load_config(QS, [*simulation_common(tmp_path, extra), "run.name=sim"]))
    sim.run()
    expected = [p.clone() for p in sim.engine.outer.params]
    for nproc in (4, 2):
        run_dir = process_runs / f"{case}-p{nproc}"
        # Every rank holds the same global parameters (each checkpoints its own engine).
        for rank_dir in ["", *(f"rank{r}" for r in range(1, nproc))]:
            assert_close_params(expected, final_global_params(run_dir, rank_dir), rtol)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["outer_steps"] == 2 and summary["workers"] == 4
        # The logged train loss is the mean over all K replicas, whichever process hosts them.
        losses = [sync_losses(sim.run_dir), sync_losses(run_dir)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-4)
        assert (
            summary["bytes_sent_per_worker"]
            == json.loads((sim.run_dir / "summary.json").read_text())["bytes_sent_per_worker"]
        )
    # Each rank kept its own replicas' state.
    assert list_checkpoints(process_runs / f"{case}-p2" / "checkpoints" / "rank1")


@pytest.mark.parametrize("case", list(PACING_CASES))
def test_pacing_by_speed_over_processes_equals_the_simulation(tmp_path, process_runs, case):
    """Pacing by speed with emulated speeds: 4 processes (each sleeping its speed's difference) end where
    the simulation (a virtual clock) does, and rank 0 logs every worker's step time."""
    extra, rtol = PACING_CASES[case]
    sim, run_dir = simulated(simulation_common(tmp_path, extra)), process_runs / f"{case}-p4"
    assert_close_params(sim.engine.outer.params, final_global_params(run_dir), rtol)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == json.loads((sim.run_dir / "summary.json").read_text())["tokens_seen"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_s"] for r in records if r["kind"] == "sync"]
    assert step_times and all(len(s) == 4 and all(v > 0 for v in s) for s in step_times)
    assert "virtual_time_s" not in summary  # processes keep real time


def test_measured_speeds_are_exchanged_and_every_rank_paces_alike(process_runs):
    """Pacing by measured speeds over 4 processes: the step times travel to every rank, which all size the
    rounds alike (the pacing state every rank checkpoints is the same) and count fewer steps than H each."""
    run_dir = process_runs / "by-speed-measured-p4"
    states = [
        load_checkpoint(list_checkpoints(run_dir / "checkpoints" / d)[-1])["pacing"]
        for d in ["", "rank1", "rank2", "rank3"]
    ]
    assert all(state == states[0] for state in states), states
    assert max(states[0]["speeds"]) == 1.0  # the fastest worker's, the others relative to it
    steps = json.loads((run_dir / "summary.json").read_text())["inner_steps"]  # 2 rounds of H = 3
    assert 2 * 4 <= states[0]["trained_steps"] <= 4 * steps  # at least a step each a round, at most H


@pytest.mark.parametrize("case", list(STREAMING_CASES))
def test_streaming_over_processes_equals_the_simulation(tmp_path, process_runs, case):
    """Streaming (P = 2, tau = 1, alpha = 0.5): the torch backend starts each fragment's collective, keeps
    training one step and only then waits; the result equals the simulation's logically completed syncs."""
    extra, rtol = STREAMING_CASES[case]
    sim, run_dir = simulated(streaming_common(tmp_path, extra)), process_runs / f"{case}-p2"
    assert_close_params(sim.engine.outer.params, final_global_params(run_dir), rtol)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fragment_syncs"] == sim.progress.fragment_syncs
    assert (
        summary["peak_bytes_per_sync"]
        == json.loads((sim.run_dir / "summary.json").read_text())["peak_bytes_per_sync"]
    )


def test_dp_over_processes_equals_simulated_dp(tmp_path, TINY):
    """fp32 method dp over processes is torch's DistributedDataParallel (its buckets all-reduced during the
    backward, as users run it); the simulation's flat all-reduce after the backward is the reference."""
    common = [*TINY, "method=dp", "workers=2", "train.batch_tokens=512", f"run.output_dir={tmp_path}"]
    sim = Trainer(load_config(QS, [*common, "run.name=sim"]))
    simulated = sim.run()
    result = launch(2, [*common, "run.name=p2"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert (simulated["dp_gradients"], summary["dp_gradients"]) == ("all_reduce", "torch_ddp")
    assert summary["bytes_sent_per_worker"] == simulated["bytes_sent_per_worker"]
    state = load_checkpoint(list_checkpoints(tmp_path / "p2" / "checkpoints")[-1])
    for a, (name, b) in zip(
        sim.replicas[0].model.parameters(), state["replicas"][0]["model"].items(), strict=True
    ):
        assert torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-6), name
    # Smaller buckets (dp.bucket_mb): more all-reduces a step, the same gradients.
    assert summary["dp_bucket_bytes"] == [sum(simulated["dp_bucket_bytes"])]  # TINY fits one 1 MiB bucket
    result = launch(2, [*common, "run.name=p2b", "dp.bucket_mb=0.01"])
    assert result.returncode == 0, result.stderr[-3000:]
    buckets = json.loads((tmp_path / "p2b" / "summary.json").read_text())["dp_bucket_bytes"]
    assert len(buckets) > 1 and sum(buckets) == sum(simulated["dp_bucket_bytes"]), buckets
    state = load_checkpoint(list_checkpoints(tmp_path / "p2b" / "checkpoints")[-1])
    for a, (name, b) in zip(
        sim.replicas[0].model.parameters(), state["replicas"][0]["model"].items(), strict=True
    ):
        assert torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-6), name


def test_mismatched_configs_across_ranks_stop_with_a_clear_message(tmp_path, TINY):
    port = free_port()
    procs = []
    for rank, lr in ((0, "0.02"), (1, "0.03")):
        dist_env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        overrides = [*TINY, f"inner.lr={lr}", f"run.output_dir={tmp_path}", "backend.torch.timeout_s=60"]
        procs.append(start_muloco("train", QS, *overrides, env=dist_env))
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 2, err
        assert "config differs across ranks" in err and "Traceback" not in err


# Time (~19 s): a run killed mid-way (after a checkpoint), a torn and a planted checkpoint, and the resume.
def test_killed_rank_stops_the_launcher_and_resume_completes(tmp_path, TINY):
    overrides = [
        *TINY,
        "method=diloco",
        "workers=2",
        "train.batch_tokens=512",
        "train.total_tokens=200000",
        "sync.every=2",
        "checkpoint.every=1",
        "checkpoint.keep=1000",
        "logging.progress=lines",
        "run.name=run",
        f"run.output_dir={tmp_path}",
        "backend.torch.timeout_s=60",
    ]
    launcher = start_muloco("launch", "--nproc", 2, QS, *overrides)
    try:
        ckpt_dir = tmp_path / "run" / "checkpoints" / "rank1"
        deadline = time.monotonic() + 90
        while len(list_checkpoints(ckpt_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        by_rank = launched_ranks(launcher)
        assert sorted(by_rank) == [0, 1]
        ranks, victim = list(by_rank.values()), by_rank[1]
        victim.kill()
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert launcher.returncode != 0 and "rank 1 exited" in err
    time.sleep(0.5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    # Writes are atomic, so no checkpoint is torn, but the ranks may stand at different steps: resume: auto
    # takes the newest step both ranks hold. Make them differ for sure, and tear rank 0's newest file too.
    rank0_dir = tmp_path / "run" / "checkpoints"
    newest = list_checkpoints(rank0_dir)[-1]
    (rank0_dir / "step_99999999.pt").write_bytes(newest.read_bytes())
    newest.write_bytes(newest.read_bytes()[:200])
    common = sorted(
        {p.name for p in list_checkpoints(rank0_dir)} & {p.name for p in list_checkpoints(ckpt_dir)}
    )
    resumed = launch(2, overrides, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = common[-2] if common[-1] == newest.name else common[-1]
    assert f"resumed checkpoint={rank0_dir / expected}" in resumed.stderr


def test_launcher_forwards_sigint_and_every_rank_checkpoints(tmp_path, TINY):
    overrides = [
        *TINY,
        "method=diloco",
        "workers=2",
        "train.batch_tokens=512",
        "train.total_tokens=400000",
        "sync.every=2",
        "logging.progress=lines",
        "run.name=run",
        f"run.output_dir={tmp_path}",
    ]
    code, err = launch_and_interrupt("--nproc", 2, QS, *overrides, timeout=60)
    assert code == 130, err[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert list_checkpoints(tmp_path / "run" / "checkpoints") and list_checkpoints(
        tmp_path / "run" / "checkpoints" / "rank1"
    )


def test_ranks_end_when_the_launcher_is_killed(tmp_path, TINY):
    overrides = [
        *TINY,
        "workers=2",
        "train.batch_tokens=512",
        "train.total_tokens=400000",
        "logging.progress=lines",
        "run.name=run",
        f"run.output_dir={tmp_path}",
    ]
    ranks = []
    launcher = start_muloco("launch", "--nproc", 2, QS, *overrides)
    try:
        assert launcher.stdout.readline().startswith("[rank 0] kind=eval")
        ranks = list(launched_ranks(launcher).values())
        assert len(ranks) == 2
        launcher.kill()  # SIGKILL: no chance to clean up; its server (or the kernel) tells the ranks
        launcher.wait(timeout=10)
        gone, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive
    finally:
        launcher.kill()
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_torchrun_works_with_the_local_backend_config(tmp_path, TINY):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "muloco",
        "train",
        QS,
        *TINY,
        "workers=2",
        "train.batch_tokens=512",
        "run.name=trun",
        f"run.output_dir={tmp_path}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "using backend.kind=torch" in result.stderr
    assert json.loads((tmp_path / "trun" / "summary.json").read_text())["status"] == "completed"
    assert list_checkpoints(tmp_path / "trun" / "checkpoints" / "rank1")


RESUME_CASES = {"adamw-fp32": ["inner.optimizer=adamw"], "muon-statistical4-ef": STAT4_EF}
RESUME_CASES["muon-statistical4-ef-reduce-scatter"] = STAT4_EF_RS


def resume_overrides(output_dir: Path, extra: list[str]) -> list[str]:
    steps = ["train.total_tokens=6144", "checkpoint.every=1", "checkpoint.keep=10"]  # 4 outer steps of H = 3
    return [*TINY, *extra, "workers=2", "train.batch_tokens=512", *steps, f"run.output_dir={output_dir}"]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> Path:
    """Every case in one go (full/), then cut to its first 2 outer steps (cut/) and resumed: one set of 2
    processes for the full runs and one for the resumes (combo_rank.py), not 6 launches."""
    directory = tmp_path_factory.mktemp("resume")
    for phase in ("full", "cut"):
        if phase == "cut":
            shutil.copytree(directory / "full", directory / "cut")
            for name in RESUME_CASES:
                for checkpoints in (
                    directory / "cut" / name / "checkpoints",
                    directory / "cut" / name / "checkpoints/rank1",
                ):
                    for path in list_checkpoints(checkpoints)[2:]:  # keep outer steps 1 and 2
                        path.unlink()
        cases = [
            {"name": name, "overrides": resume_overrides(directory / phase, x), "port": free_port()}
            for name, x in RESUME_CASES.items()
        ]
        (directory / f"ranks-{phase}").mkdir()
        run_combo_ranks("torch", 2, cases, directory / f"ranks-{phase}", QS, timeout=300)
    return directory


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_over_processes_is_bitwise_identical(resume_runs, case):
    """2R outer steps in one go == R steps, stop, resume, R steps: 2 torch processes, bit for bit."""
    extra, full, cut = RESUME_CASES[case], resume_runs / "full" / case, resume_runs / "cut" / case
    resumed_from = cut / "checkpoints" / "step_00000006.pt"
    assert (
        f"resumed checkpoint={resumed_from} step=6" in (resume_runs / "ranks-cut" / "rank0.log").read_text()
    )
    for rank_dir in ("", "rank1"):
        a = load_checkpoint(list_checkpoints(full / "checkpoints" / rank_dir)[-1])
        b = load_checkpoint(list_checkpoints(cut / "checkpoints" / rank_dir)[-1])
        for x, y in zip(a["engine"]["outer"]["params"], b["engine"]["outer"]["params"], strict=True):
            assert torch.equal(x, y)
        for x, y in zip(a["replicas"][0]["model"].values(), b["replicas"][0]["model"].values(), strict=True):
            assert torch.equal(x, y)
        # reduce_scatter: each rank's part owner kept its second-stage error feedback through the resume.
        for owner_a, owner_b in zip(a["engine"]["owner_error_feedback"], b["engine"]["owner_error_feedback"]):
            assert (owner_a is None) == (owner_b is None) == ("sync.transport=reduce_scatter" not in extra)
            for key, value in (owner_a or {"buffers": {}})["buffers"].items():
                assert torch.equal(value, owner_b["buffers"][key])
