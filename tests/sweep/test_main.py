"""muloco/sweep/main.py: `muloco sweep` end to end: exit codes, --dry-run, the report, resume."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import TINY
from test_helpers import run_muloco as muloco

from muloco.config import parse_override
from muloco.sweep.main import sweep_main

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_a_failed_run_makes_the_sweep_exit_1_and_name_it(
    tmp_path, monkeypatch, caplog, write_sweep, FakeProcess
):
    def launch(spec, run, log_path):
        return FakeProcess(run.run_dir, code=1 if run.name == "w2" else 0)

    monkeypatch.setattr("muloco.sweep.runner.start_process", launch)
    path = write_sweep({"grid": {"workers": [1, 2, 4]}})
    with caplog.at_level("INFO", logger="muloco"):
        assert sweep_main(path, jobs=3) == 1
    assert "failed=1: w2 (exit code 1" in caplog.text
    assert (tmp_path / "out" / "report.md").is_file()  # the report covers what finished


# --- the CLI -------------------------------------------------------------------------------------------


def test_malformed_sweep_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"base": str(QUICKSTART), "grid": {"workers": [1, 2], "sync.every": [3]}}))
    path.write_text(path.read_text() + "zip: [[workers, sync.every]]\n")
    result = muloco("sweep", path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "same length" in lines[0]


def test_dry_run_lists_runs_and_runs_nothing(tmp_path, capsys, write_sweep):
    from muloco.cli import main

    path = write_sweep({"grid": {"inner.optimizer": ["adamw", "muon"]}, "baselines": "auto"})
    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("adamw", "muon", "dp-baseline_adamw", "dp-baseline_muon"):
        assert f"  {name} " in out
    assert "inner.optimizer=muon" in out and "4 runs (2 DP baselines)" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
def test_sweep_end_to_end_then_resume(tmp_path, write_sweep):
    fixed = {".".join(k): v for k, v in map(parse_override, TINY)}
    fixed["train.threads"] = 1  # a tiny model: more threads only contend (the machine may be busy)
    path = write_sweep({"fixed": fixed, "grid": {"workers": [2]}, "baselines": "auto"})
    result = muloco("sweep", path, "--jobs", "1", timeout=180)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    for name in ("run", "dp-baseline"):
        assert json.loads((out / name / "summary.json").read_text())["status"] == "completed"
        assert "done status=completed" in (out / name / "train.log").read_text()
    assert (out / "summary.csv").is_file() and (out / "report.md").is_file()
    assert (out / "loss_vs_tokens.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    again = muloco("sweep", path, "--jobs", "1")
    assert again.returncode == 0 and "completed_before=2 to_run=0" in again.stderr


@pytest.mark.slow(seconds=60)  # 36 runs of a micro model, 2 at a time: ~2 min on 2 cores (flagship quick)
def test_the_flagship_sweeps_quick_variant_ends_in_a_tuned_report(tmp_path):
    """configs/sweeps/inner_optimizers_quick.yaml, as shipped but for where its runs go: every run completes,
    and the report holds the tuned comparison, a row per optimizer and K, each against DP over both seeds."""
    shipped = QUICKSTART.parent / "sweeps" / "inner_optimizers_quick.yaml"
    body = yaml.safe_load(shipped.read_text())
    body["base"] = str(shipped.parent / body["base"])
    body["output_dir"] = str(tmp_path / "out")
    body["fixed"]["train.threads"] = 1
    path = tmp_path / "quick.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    result = muloco("sweep", path, "--jobs", "2", timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]

    out = tmp_path / "out"
    assert json.loads((out / "sweep.json").read_text())["tune"] == body["tune"]
    rows = json.loads((out / "tuned.json").read_text())["rows"]
    cells = {(r["cell"]["settings"]["inner.optimizer"], r["cell"]["settings"]["workers"]) for r in rows}
    assert cells == {(o, k) for o in ("adamw", "muon", "lion") for k in (1, 2)}
    for row in rows:
        assert row["dp"]["settings"]["workers"] == 2 and row["seeds"] == [0, 1], row
        assert len(row["pct_over_dp_per_seed"]) == 2 and row["pct_over_dp"] is not None
        tried = row["cell"]["tried"]["inner.adamw.lr" if row["cell"]["settings"]["inner.optimizer"] == "adamw"
                                     else "inner.lr"]  # fmt: skip
        assert len(tried) == 2 and row["cell"]["chosen_on_seeds"] == [0, 1]
    report = (out / "report.md").read_text()
    assert "## Tuned comparison" in report and "tuned_gap_vs_workers.png" in report
    assert (out / "tuned_gap_vs_workers.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
