"""Asynchronous outer updates over processes (run/async_processes.py, sync/param_owner.py): two torch ranks,
the global parameters on rank 0. The machines decide the order of arrivals, so the reference replays the
order the run logged: each worker's window from the global parameters right after its previous arrival
(its pull), and Liu et al.'s Algorithm 3 (c = 0) worked by hand. A signal stops every worker after the
window it is in, all of which arrive; the resumed run ends on the budget with no window lost."""

import json
from pathlib import Path

import pytest
import torch
from test_helpers import DelayedNesterovByHand, launch_and_interrupt, run_muloco

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.compress import CompressionError
from muloco.config import load_config
from muloco.run.trainer import Trainer
from muloco.sync.arrivals import Arrivals, fp32_message
from muloco.sync.delayed_nesterov import DelayedNesterov

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")

# K = 2 at emulated speeds 1 and 0.5 (the slower one sleeps), windows of H = 2, 8 steps of budget a worker.
ASYNC = [
    "workers=2",
    "train.total_tokens=2048",
    "sync.every=2",
    "sync.mode=async",
    "train.speed=[1.0, 0.5]",
    "train.lr_schedule=constant",
    "train.warmup_steps=0",
    "inner.optimizer=adamw",
    "outer.lr=0.7",
    "outer.momentum=0.9",
]


def records(run_dir: Path, kind: str = "sync") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_global(run_dir: Path, rank_dir: str = "") -> list[torch.Tensor]:
    state = load_checkpoint(list_checkpoints(run_dir / "checkpoints" / rank_dir)[-1])
    return state["engine"]["outer"]["params"]


def replayed_by_hand(overrides: list[str], syncs: list[dict], every: int) -> list[torch.Tensor]:
    """The windows of `syncs` in their order: worker w's from the global parameters after its previous
    arrival, trained by the replicas of a one-process run of the same config (same init, same data
    streams), each applied by Algorithm 3 worked by hand."""
    lr, beta = 0.7, 0.9
    trainer = Trainer(load_config(QS, [*overrides, "sync.mode=sync", "backend.kind=local"]))
    replicas = trainer.replicas
    theta = [p.detach().clone() for p in replicas[0].model.parameters()]
    pulled = [[p.clone() for p in theta] for _ in replicas]
    last_arrival = [0, 0]
    outer = DelayedNesterovByHand(theta, lr, beta, every)
    for arrival, record in enumerate(syncs, start=1):
        w = record["worker"]
        assert record["staleness"] == arrival - 1 - last_arrival[w]  # arrivals since its pull
        last_arrival[w] = arrival
        replica = replicas[w]
        with torch.no_grad():
            for q, p in zip(replica.model.parameters(), pulled[w], strict=True):
                q.copy_(p)
        for _ in range(record["window_steps"]):
            replica.train_step(trainer.micro_batches, trainer.seqs_per_micro, 1.0, 1.0, trainer.autocast)
        outer.arrive([b - p.detach() for b, p in zip(pulled[w], replica.model.parameters(), strict=True)])
        pulled[w] = [p.clone() for p in theta]
    return theta


@pytest.mark.slow(seconds=25)
def test_async_over_processes_equals_delayed_nesterov_in_the_logged_order(tmp_path, TINY):
    overrides = [*TINY, *ASYNC, f"run.output_dir={tmp_path}", "run.name=run"]
    result = run_muloco("launch", "--nproc", 2, QS, "backend.kind=torch", *overrides, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    syncs = records(run_dir)
    # Equal tokens: the windows add up to the budget, the faster worker handed in at least as many.
    assert sum(r["window_steps"] for r in syncs) == 2 * 8
    windows = [sum(1 for r in syncs if r["worker"] == w) for w in (0, 1)]
    assert windows[0] >= windows[1] >= 1, windows
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["transport"] == "point_to_point" and summary["tokens_seen"] == 2048
    assert summary["inner_steps"] == 8 and summary["fragment_syncs"] == len(syncs)
    expected = replayed_by_hand([*TINY, *ASYNC, f"run.output_dir={tmp_path}", "run.name=hand"], syncs, 2)
    got = final_global(run_dir)
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    # The run ends on one model: rank 1 holds rank 0's global parameters.
    for a, b in zip(got, final_global(run_dir, "rank1"), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow(seconds=40)
def test_a_signal_stops_every_worker_after_its_window_and_the_resumed_run_loses_none(tmp_path, TINY):
    overrides = [
        *TINY,
        *ASYNC,
        "compression.scheme=statistical",
        "compression.bits=4",
        "compression.error_feedback=true",
        "train.total_tokens=102400",  # 400 steps a worker: the signal falls well inside
        "logging.progress=lines",
        f"run.output_dir={tmp_path}",
        "run.name=run",
    ]
    code, err = launch_and_interrupt("--nproc", 2, QS, "backend.kind=torch", *overrides)
    assert code == 130, err[-2000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    first = records(run_dir)
    # Every window trained arrived: the credited steps are the windows' sum, and both ranks' checkpoints
    # are at the same step.
    assert summary["tokens_seen"] == sum(r["window_steps"] for r in first) * 128 > 0
    steps = {p.name for p in list_checkpoints(run_dir / "checkpoints")}
    assert steps == {p.name for p in list_checkpoints(run_dir / "checkpoints" / "rank1")}
    assert summary["inner_steps"] < 400

    resumed = run_muloco("launch", "--nproc", 2, QS, "backend.kind=torch", *overrides, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed checkpoint=" in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["tokens_seen"] == 102400
    assert sum(r["window_steps"] for r in records(run_dir)) == 2 * 400  # both sessions, no window lost


def test_the_owner_refuses_an_fp32_message_of_another_size():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    book = Arrivals(params=params, outer=DelayedNesterov(params, 1.0, 0.9, 2), workers=2, total_steps=4)
    book.window = lambda worker: 3
    assert book.claim(0) == 3 and book.claim(1) == 3 and book.claim(0) == 2 and book.claim(1) == 0
    with pytest.raises(CompressionError, match="fp32 pseudogradient of 16 entries"):
        book.apply(3, fp32_message([torch.ones(16)]))
    norm, payload = book.apply(3, fp32_message([torch.ones(3, 4), torch.ones(5)]))
    assert payload == 4 * 17 and norm == pytest.approx(17**0.5 / 2)  # lr g / N, no momentum yet
    assert torch.equal(params[1], torch.full((5,), -0.5))
