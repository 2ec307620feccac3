"""experiments/gpu/check.sh --smoke: the prepared GPU check runs every step on the CPU, so it cannot rot
before a GPU machine is lent."""

import json
import subprocess

import pytest


@pytest.mark.slow(seconds=30)  # four benchmark subprocesses: about a minute on 2 cores
def test_gpu_check_smoke_runs_every_step_and_writes_its_summary(tmp_path):
    done = subprocess.run(
        ["bash", "experiments/gpu/check.sh", "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert [step["rc"] for step in report["steps"]] == [0, 0, 0, 0]
    assert "skipped" in report["steps"][0]["output"]  # no CUDA here: the cuda tests say why they skip
    simulation = json.loads((tmp_path / "bench_simulation_small.json").read_text())
    cases = {row["case"]: row for row in simulation["tables"]["1"]}
    assert {"dp K=8", "diloco K=2 sequential", "diloco K=2 batched"} <= set(cases)
    assert all(row["train_tokens_per_s"] > 0 for row in cases.values())
    muon = json.loads((tmp_path / "bench_muon.json").read_text())
    assert muon["step_ms"] and muon["matrices"] == 8  # 2 layers x (qkv, proj, fc, mlp.proj)
    forward = json.loads((tmp_path / "bench_batched_forward.json").read_text())
    assert [row["way"] for row in forward["rows"]] == [
        "one after another",
        "vmap, one call",
        "DP, union batch",
    ]
    summary = (tmp_path / "check.md").read_text()
    assert "| pytest -m cuda | 0 |" in summary and "simulated workers vs DP" in summary
