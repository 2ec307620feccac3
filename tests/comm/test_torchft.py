"""The torchft backend (loopback lighthouse, gloo): equal to the torch backend without failures; a killed
worker does not stop the others, and a restarted one adopts their state live and ends equal to them;
an unreachable lighthouse and a quorum that cannot form end with one line, never a hang."""

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY
from test_helpers import (
    assert_same_global_params,
    final_global_params,
    launched_ranks,
    run_combo_ranks,
    run_muloco,
    start_muloco,
    sync_records,
)

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.net.launch import free_port

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")
STAT4_EF = ["compression.scheme=statistical", "compression.bits=4", "compression.error_feedback=true"]
STREAMING = [
    "sync.fragments=2",
    "sync.overlap=1",
]  # fragment 0 syncs at steps 3, 6, ..., fragment 1 at 1, 4, ...
# A whole window overlapped (tau = H = 3): the sync started after round r applied after round r + 1.
WHOLE_WINDOW = ["sync.overlap=3"]


def common(tmp_path, TINY, outer_steps=8, every=3):
    return [
        *TINY,
        "workers=3",
        "train.batch_tokens=384",
        f"train.total_tokens={384 * every * outer_steps}",
        f"sync.every={every}",
        f"run.output_dir={tmp_path}",
    ]


# Each case's overrides beside the common ones, and the tolerance against the torch backend.
EQUALITY_CASES = {
    "adamw-fp32": (["inner.optimizer=adamw"], 1e-6),  # gloo's all-reduce over the quorum vs the torch world
    "muon-fp32": (["inner.optimizer=muon", "inner.ns_dtype=fp32"], 1e-6),
    # Compressed: every member decodes every message in the same order as the torch ranks.
    "muon-statistical4-ef": (["inner.optimizer=muon", *STAT4_EF, "sync.transport=all_gather"], 0.0),
    "adamw-streaming": (["inner.optimizer=adamw", *STREAMING], 1e-6),  # a quorum per fragment's sync
    "muon-stat4-ef-window": (["inner.optimizer=muon", *STAT4_EF, *WHOLE_WINDOW], 0.0),
    "muon-stat4-ef-eager": (["inner.optimizer=muon", *STAT4_EF, *WHOLE_WINDOW, "sync.eager=true"], 0.0),
}


@pytest.fixture(scope="module")
def equality_runs(tmp_path_factory) -> Path:
    """Every equality case over torchft (a lighthouse and 3 workers per case) and over torch (a world of 3),
    in one set of 3 processes per backend (combo_rank.py, wired as `muloco launch` wires them): torch and
    torchft start once per backend rather than once per case (~72 s as 8 launches)."""
    directory = tmp_path_factory.mktemp("equality")
    for backend in ("torchft", "torch"):
        cases = [
            {"name": name, "overrides": [*common(directory, TINY), *extra], "port": free_port()}
            for name, (extra, _) in EQUALITY_CASES.items()
        ]
        (directory / backend).mkdir()
        run_combo_ranks(backend, 3, cases, directory / backend, QS, timeout=420)
    return directory


@pytest.mark.parametrize("case", list(EQUALITY_CASES))
def test_three_workers_equal_the_torch_backend(equality_runs, case):
    extra, rtol = EQUALITY_CASES[case]
    reference = final_global_params(equality_runs / case)
    syncs = len(sync_records(equality_runs / case))
    assert syncs == (17 if "sync.fragments=2" in extra else 8)  # streaming: 2 per outer step, 1 at the end
    for i in range(3):
        run_dir = equality_runs / f"{case}-worker{i}"
        assert [r["quorum_size"] for r in sync_records(run_dir)] == [3] * syncs
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["quorum_size_min"] == 3 and summary["heals"] == 0
        for a, b in zip(final_global_params(run_dir), reference, strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=1e-7 if rtol else 0.0)


def _wait_for_syncs(run_dir: Path, count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(sync_records(run_dir)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir.name} did not reach {count} syncs")


def _kill_worker(launcher, process: int) -> None:
    """SIGKILL the launcher's process-th process (a worker's rank; one rank per worker: worker `process`)."""
    launched_ranks(launcher)[process].kill()


def _lighthouse_of(launcher) -> str:
    return next(
        arg.split("=", 1)[1]
        for arg in launched_ranks(launcher)[0].cmdline()
        if arg.startswith("backend.torchft.lighthouse=")
    )


@pytest.mark.parametrize("sync", [[], STREAMING], ids=["whole-model", "streaming"])
def test_a_killed_worker_does_not_stop_the_others(tmp_path, TINY, sync):
    overrides = [*common(tmp_path, TINY), *sync, "backend.torchft.heartbeat_timeout_s=2", "run.name=ft"]
    launcher = start_muloco("launch", "--nproc", 3, "--backend", "torchft", QS, *overrides)
    try:
        _wait_for_syncs(tmp_path / "ft-worker2", 2)
        _kill_worker(launcher, 2)  # SIGKILL at outer step 2 of 8
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
    assert launcher.returncode != 0 and "worker 2 exited" in err and "the others go on" in err
    assert "backend.torchft.replica_id=2" in err  # ... with the command that brings it back
    for i in (0, 1):
        run_dir = tmp_path / f"ft-worker{i}"
        summary = json.loads((run_dir / "summary.json").read_text())
        records = sync_records(run_dir)
        assert summary["status"] == "completed" and len(records) == (17 if sync else 8)
        # A sync applied at once that the victim died in is retried without it; one in flight is dropped.
        assert summary["dropped_syncs"] == 0 or sync
        assert summary["outer_steps"] == (len(records) - summary["dropped_syncs"]) // (2 if sync else 1)
        assert summary["quorum_size_min"] == 2 and summary["quorum_size_last"] == 2
        sizes = [r["quorum_size"] for r in records]
        assert sizes[:2] == [3, 3] and sizes[-1] == 2
    assert_same_global_params(tmp_path / "ft-worker0", tmp_path / "ft-worker1")


@pytest.mark.parametrize(
    "sync",
    # (a naive whole window heals as eager's does, minus the eager restart: eager covers both)
    [[], STREAMING, [*WHOLE_WINDOW, "sync.eager=true"]],
    ids=["whole-model", "streaming", "eager"],
)
# Time (~24 s a case): the lighthouse must drop the victim (heartbeat_timeout_s=15, the margin a
# replacement needs to start on 2 busy cores) before the survivors' quorum lets the replacement join.
def test_a_restarted_worker_recovers_the_state_live_and_ends_equal(tmp_path, TINY, sync):
    # The lighthouse drops the victim after the heartbeat timeout; its replacement, started at once,
    # heartbeats before that, so the survivors' next quorum waits for it (the join timeout): it joins then.
    # Streaming: the replacement plans its first sync for its own step's fragment and joins the quorum's.
    overrides = [*common(tmp_path, TINY), *sync, "backend.torchft.heartbeat_timeout_s=15", "run.name=ft"]
    launcher = start_muloco("launch", "--nproc", 3, "--backend", "torchft", QS, *overrides)
    replacement = None
    try:
        _wait_for_syncs(tmp_path / "ft-worker2", 2)
        lighthouse = _lighthouse_of(launcher)
        _kill_worker(launcher, 2)
        back = [*overrides, "backend.kind=torchft", f"backend.torchft.lighthouse={lighthouse}"]
        back.append("backend.torchft.hostname=127.0.0.1")  # as the launcher's workers (and its hint)
        replacement = start_muloco("train", QS, *back, "backend.torchft.replica_id=2", "run.name=back")
        _, replacement_err = replacement.communicate(timeout=240)
        launcher.wait(timeout=240)
    finally:
        for p in (launcher, replacement):
            if p is not None:
                p.kill()
                p.wait(timeout=10)
    assert replacement.returncode == 0, replacement_err[-3000:]
    adopted = [line for line in replacement_err.splitlines() if "adopted the quorum's state live" in line]
    assert len(adopted) == 1 and "step=0 " not in adopted[0]
    records = sync_records(tmp_path / "back")
    assert records[0]["healed"] and records[0]["quorum_size"] == 3 and records[-1]["step"] == 24
    if sync == STREAMING:  # its first sync is the quorum's: the fragment and step the others synced
        survivor = {(r["fragment"], r["started_step"]) for r in sync_records(tmp_path / "ft-worker0")}
        assert (records[0]["fragment"], records[0]["started_step"]) in survivor
        assert f"joining its sync of fragment {records[0]['fragment']} " in adopted[0]
    assert json.loads((tmp_path / "back" / "summary.json").read_text())["heals"] == 1
    assert_same_global_params(tmp_path / "ft-worker0", tmp_path / "ft-worker1", tmp_path / "back")


# Workers of R = 2 ranks: each a torch.distributed world of its own (inner steps), its lead in the quorums.
TWO_RANKS = [
    "workers=2",
    "ranks_per_worker=2",
    "train.micro_batch_tokens=64",
    f"train.total_tokens={256 * 24}",
]


# Time (~24 s): a torchft launch of 2 workers x 2 ranks and the torch launch it must equal.
def test_workers_of_two_ranks_equal_the_torch_backend(tmp_path, TINY):
    overrides = [*TINY, *TWO_RANKS, f"run.output_dir={tmp_path}"]
    ft = run_muloco(
        "launch", "--nproc", 4, "--backend", "torchft", QS, *overrides, "run.name=ft", timeout=240
    )
    assert ft.returncode == 0, ft.stderr[-3000:]
    torch_run = run_muloco("launch", "--nproc", 4, QS, *overrides, "run.name=torch", timeout=240)
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    for i in range(2):
        assert [r["quorum_size"] for r in sync_records(tmp_path / f"ft-worker{i}")] == [2] * 8
        for a, b in zip(
            final_global_params(tmp_path / f"ft-worker{i}"), final_global_params(tmp_path / "torch")
        ):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# Time (~29 s): as the restarted-worker test, with workers of 2 ranks (5 processes and a lighthouse).
def test_a_worker_of_two_ranks_that_loses_one_is_reported_and_rejoins_live(tmp_path, TINY):
    overrides = [*TINY, *TWO_RANKS, f"run.output_dir={tmp_path}", "backend.torchft.heartbeat_timeout_s=15"]
    launcher = start_muloco("launch", "--nproc", 4, "--backend", "torchft", QS, *overrides, "run.name=ft")
    replacement = None
    try:
        _wait_for_syncs(tmp_path / "ft-worker1", 2)
        lighthouse = _lighthouse_of(launcher)
        _kill_worker(launcher, 3)  # worker 1's second rank: the launcher ends its first one too
        # The command the launcher prints: both ranks again, joining the running lighthouse as worker 1.
        back = [*overrides, f"backend.torchft.lighthouse={lighthouse}", "backend.torchft.replica_id=1"]
        replacement = start_muloco("launch", "--backend", "torchft", "--nproc", 2, QS, *back, "run.name=back")
        _, replacement_err = replacement.communicate(timeout=240)
        _, err = launcher.communicate(timeout=240)
    finally:
        for p in (launcher, replacement):
            if p is not None:
                p.kill()
                p.wait(timeout=10)
    assert "worker 1 exited" in err and "launch --backend torchft --nproc 2" in err
    assert "backend.torchft.replica_id=1" in err
    assert json.loads((tmp_path / "ft-worker0" / "summary.json").read_text())["status"] == "completed"
    assert replacement.returncode == 0, replacement_err[-3000:]
    adopted = [line for line in replacement_err.splitlines() if "adopted the quorum's state live" in line]
    assert len(adopted) == 1 and adopted[0].startswith("[rank 0]")  # its lead; rank 1 took it from the lead
    assert sync_records(tmp_path / "back-worker1")[0]["healed"]
    assert_same_global_params(tmp_path / "ft-worker0", tmp_path / "back-worker1")
    # Both ranks of the rejoined worker hold the same global state (rank 1's checkpoint).
    rank1 = list_checkpoints(tmp_path / "back-worker1" / "checkpoints" / "rank1")[-1]
    lead = final_global_params(tmp_path / "back-worker1")
    assert all(map(torch.equal, lead, load_checkpoint(rank1)["engine"]["outer"]["params"]))


def test_an_unreachable_lighthouse_is_one_line_and_exit_2(tmp_path, TINY):
    result = run_muloco(
        "train",
        QS,
        *common(tmp_path, TINY),
        "backend.kind=torchft",
        f"backend.torchft.lighthouse=http://127.0.0.1:{free_port()}",
        timeout=120,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "backend.torchft.lighthouse: cannot reach the lighthouse" in lines[-1]
    assert "Traceback" not in result.stderr


def test_a_quorum_that_cannot_form_is_logged_and_retried_then_fails(tmp_path, TINY):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)  # a second worker never comes
    try:
        address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
        started = time.monotonic()
        result = run_muloco(
            "train",
            QS,
            *common(tmp_path, TINY),
            "backend.kind=torchft",
            f"backend.torchft.lighthouse={address}",
            "backend.torchft.wait_for_workers=1",
            "backend.torchft.quorum_timeout_s=2",
            "backend.torchft.quorum_retries=1",
            timeout=120,
        )
        elapsed = time.monotonic() - started
    finally:
        lighthouse.shutdown()
    assert result.returncode == 1, result.stderr[-2000:]
    assert elapsed > 2 * 2  # each attempt asked the lighthouse anew and waited its quorum_timeout_s
    assert "no quorum" in result.stderr and "retrying with a new quorum (attempt 2 of 2)" in result.stderr
    assert "failed 2 times in a row" in result.stderr.splitlines()[-1]
