"""Workers of R ranks (docs/topology.md): K workers x R ranks equals K simulated workers."""

import json
from pathlib import Path

import pytest
from test_helpers import assert_equal_up_to_rounding, run_muloco

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")


def final_global_params(run_dir: Path):
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["engine"]["outer"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["workers=2", "inner.optimizer=adamw"],
        ["workers=2", "inner.ns_dtype=fp32"],  # distributed Muon inside each worker
        # 2 worker groups x 2 ranks hosting 2 replicas each, streaming with tau = 1 and 4-bit messages.
        [
            "workers=4",
            "inner.ns_dtype=fp32",
            "sync.every=4",
            "sync.fragments=2",
            "sync.overlap=1",
            "compression.scheme=statistical",
            "compression.bits=4",
            "sync.transport=all_gather",
        ],
        # The lead ranks reduce-scatter (each owns its worker's 2 parts) and broadcast to their worker.
        [
            "workers=4",
            "inner.ns_dtype=fp32",
            "compression.scheme=statistical",
            "compression.bits=4",
            "compression.error_feedback=true",
            "sync.transport=reduce_scatter",
        ],
    ],
    ids=["K2xR2-adamw", "K2xR2-distributed-muon", "hybrid-streaming-4bit", "hybrid-4bit-ef-reduce-scatter"],
)
def test_workers_of_two_ranks_equal_the_simulation(tmp_path, TINY, extra):
    common = [
        *TINY,
        *extra,
        "train.batch_tokens=1024",
        "train.micro_batch_tokens=128",  # 2 or 4 micro-batches per worker step, split over R = 2 ranks
        "train.total_tokens=6144",
        f"run.output_dir={tmp_path}",
    ]
    sim = Trainer(load_config(QS, [*common, "run.name=sim"]))
    sim.run()
    result = run_muloco(
        "launch", "--nproc", 4, QS, *common, "ranks_per_worker=2", "run.name=ranks", timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for a, b in zip(sim.engine.outer.params, final_global_params(tmp_path / "ranks"), strict=True):
        assert_equal_up_to_rounding(b, a)
    summary = json.loads((tmp_path / "ranks" / "summary.json").read_text())
    expected = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["ranks_per_worker"] == 2 and summary["outer_steps"] == expected["outer_steps"]
    assert summary["bytes_sent_per_worker"] == expected["bytes_sent_per_worker"]
    # The logged train loss is the workers' mean whichever way a step's micro-batches were split.
    assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-5)


def test_ranks_per_worker_needs_processes(tmp_path, TINY):
    result = run_muloco(
        "train", QS, *TINY, f"run.output_dir={tmp_path}", "ranks_per_worker=2", "train.micro_batch_tokens=32"
    )
    assert result.returncode == 2
    assert "ranks_per_worker (2) must divide the number of processes (1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_ranks_per_worker_must_divide_the_micro_batches(TINY):
    result = run_muloco("config", QS, *TINY, "ranks_per_worker=3")
    assert result.returncode == 2 and "ranks_per_worker (3) must divide" in result.stderr
