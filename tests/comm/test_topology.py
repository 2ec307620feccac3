"""Workers of R ranks (docs/topology.md): K workers x R ranks equals K simulated workers."""

import json
from pathlib import Path

import pytest
from conftest import TINY
from test_helpers import assert_equal_up_to_rounding, run_combo_ranks, run_muloco_here

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.config import load_config
from muloco.net.launch import free_port
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
QS = str(ROOT / "configs/quickstart.yaml")


def final_global_params(run_dir: Path):
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["engine"]["outer"]["params"]


# Each case's overrides beside the common ones.
RANKS_CASES = {
    "K2xR2-adamw": ["workers=2", "inner.optimizer=adamw"],
    "K2xR2-distributed-muon": ["workers=2", "inner.ns_dtype=fp32"],  # distributed Muon inside each worker
    # Any other optimizer (issue 38) is replicated on a worker's ranks (same averaged gradients).
    "K2xR2-lion": ["workers=2", "inner.optimizer=lion", "inner.lr=0.003"],
    # 2 worker groups x 2 ranks hosting 2 replicas each, streaming with tau = 1 and 4-bit messages.
    "hybrid-streaming-4bit": [
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
    "hybrid-4bit-ef-reduce-scatter": [
        "workers=4",
        "inner.ns_dtype=fp32",
        "compression.scheme=statistical",
        "compression.bits=4",
        "compression.error_feedback=true",
        "sync.transport=reduce_scatter",
    ],
}


def ranks_common(output_dir: Path, extra: list[str]) -> list[str]:
    return [
        *TINY,
        *extra,
        "train.batch_tokens=1024",
        "train.micro_batch_tokens=128",  # 2 or 4 micro-batches per worker step, split over R = 2 ranks
        "train.total_tokens=6144",
        f"run.output_dir={output_dir}",
    ]


@pytest.fixture(scope="module")
def ranks_runs(tmp_path_factory) -> Path:
    """Every case over 4 processes with ranks_per_worker=2, in one set of 4 processes (combo_rank.py, wired
    as `muloco launch` wires them): torch starts once, not once per case."""
    directory = tmp_path_factory.mktemp("ranks")
    cases = [
        {
            "name": name,
            "overrides": [*ranks_common(directory, extra), "ranks_per_worker=2"],
            "port": free_port(),
        }
        for name, extra in RANKS_CASES.items()
    ]
    (directory / "ranks").mkdir()
    run_combo_ranks("torch", 4, cases, directory / "ranks", QS, timeout=300)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RANKS_CASES))
def test_workers_of_two_ranks_equal_the_simulation(tmp_path, ranks_runs, case):
    sim = Trainer(load_config(QS, [*ranks_common(tmp_path, RANKS_CASES[case]), "run.name=sim"]))
    sim.run()
    for a, b in zip(sim.engine.outer.params, final_global_params(ranks_runs / case), strict=True):
        assert_equal_up_to_rounding(b, a)
    summary = json.loads((ranks_runs / case / "summary.json").read_text())
    expected = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["ranks_per_worker"] == 2 and summary["outer_steps"] == expected["outer_steps"]
    assert summary["bytes_sent_per_worker"] == expected["bytes_sent_per_worker"]
    # The logged train loss is the workers' mean whichever way a step's micro-batches were split.
    assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-5)


def test_ranks_per_worker_needs_processes(tmp_path, TINY):
    result = run_muloco_here(
        "train", QS, *TINY, f"run.output_dir={tmp_path}", "ranks_per_worker=2", "train.micro_batch_tokens=32"
    )
    assert result.returncode == 2
    assert "ranks_per_worker (2) must divide the number of processes (1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_ranks_per_worker_must_divide_the_micro_batches(TINY):
    result = run_muloco_here("config", QS, *TINY, "ranks_per_worker=3")
    assert result.returncode == 2 and "ranks_per_worker (3) must divide" in result.stderr
