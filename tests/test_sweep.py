"""Sweeps: grid/zip/exclude expansion, DP baselines, run names, up-front validation, resume, the CLI."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import TINY
from test_helpers import run_muloco as muloco

from muloco.config import load_config, parse_override
from muloco.errors import ConfigError
from muloco.sweep import (
    _read_back,
    dp_baseline_assignment,
    expand_grid,
    load_sweep,
    override_text,
    parse_sweep,
    plan_sweep,
    run_names,
    run_sweep,
)

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SHIPPED = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


def write_sweep(tmp_path, body: dict, name="sweep.yaml") -> Path:
    body = {"base": str(QUICKSTART), "output_dir": str(tmp_path / "out"), **body}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# --- expansion ----------------------------------------------------------------------------------------


def test_grid_is_the_product_first_key_outermost():
    runs = expand_grid({"inner.optimizer": ["adamw", "muon"], "workers": [1, 4]})
    assert runs == [
        {"inner.optimizer": "adamw", "workers": 1},
        {"inner.optimizer": "adamw", "workers": 4},
        {"inner.optimizer": "muon", "workers": 1},
        {"inner.optimizer": "muon", "workers": 4},
    ]
    assert expand_grid({}) == [{}]


def test_zip_advances_keys_together_and_exclude_drops_matching_runs():
    grid = {"sync.every": [15, 30, 60], "inner.optimizer": ["adamw", "muon"], "outer.lr": [0.5, 0.7, 0.9]}
    runs = expand_grid(grid, [["sync.every", "outer.lr"]])
    assert [(r["sync.every"], r["outer.lr"]) for r in runs[::2]] == [(15, 0.5), (30, 0.7), (60, 0.9)]
    assert len(runs) == 6 and list(runs[0]) == list(grid)  # keys stay in grid order
    kept = expand_grid(grid, [["sync.every", "outer.lr"]], [{"sync.every": 60, "inner.optimizer": "muon"}])
    assert len(kept) == 5 and {"sync.every": 60, "inner.optimizer": "muon", "outer.lr": 0.9} not in kept


def test_dp_baseline_keeps_optimizer_and_workers_and_drops_what_dp_ignores():
    run = {"inner.optimizer": "muon", "workers": 4, "sync.every": 30, "compression.bits": 2, "outer.lr": 0.5}
    assert dp_baseline_assignment(run) == {"method": "dp", "inner.optimizer": "muon", "workers": 4}


# --- names --------------------------------------------------------------------------------------------


def test_run_names_are_readable_unique_deterministic_and_safe():
    runs = expand_grid({"inner.optimizer": ["adamw", "muon"], "workers": [1, 4], "run.seed": [0]})
    assert run_names(runs) == ["adamw_w1", "adamw_w4", "muon_w1", "muon_w4"]  # constant keys left out
    odd = [{"data.path": "a/b c"}, {"data.path": "a_b?c"}, {"data.path": "a b/c"}]
    names = run_names(odd)
    assert names == run_names(odd) and len(set(names)) == 3
    assert all(n.replace("_", "").replace("-", "").replace(".", "").isalnum() for n in names), names
    both = run_names([{"inner.lr": 0.01, "outer.lr": 0.7}, {"inner.lr": 0.02, "outer.lr": 0.5}])
    assert both == ["inner.lr-0.01_outer.lr-0.7", "inner.lr-0.02_outer.lr-0.5"]


def test_fp32_runs_leave_out_bits_and_error_feedback():
    runs = [
        {"compression.scheme": "none", "compression.bits": 8, "compression.error_feedback": False},
        {"compression.scheme": "statistical", "compression.bits": 2, "compression.error_feedback": True},
    ]
    assert run_names(runs) == ["fp32", "statistical_2bit_ef"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("inner.optimizer", "muon"),
        ("logging.progress", "off"),  # YAML would read a bare off as False
        ("run.name", "no"),  # ... and this as False too
        ("inner.lr", 0.001),
        ("inner.lr", 1e-5),
        ("workers", 4),
        ("compression.error_feedback", True),
        ("data.path", None),
        ("inner.adamw.betas", [0.9, 0.99]),
    ],
)
def test_overrides_read_back_as_the_same_value(key, value):
    text = override_text(key, value)
    assert text is not None and text.startswith(f"{key}=") and _read_back(text) == value


def test_values_mean_what_they_mean_in_a_config_file(tmp_path):
    # `off` is YAML's False; in a config file the schema reads it as "off", and so does a sweep.
    fixed = {"logging.progress": False, "inner.adamw.betas": [0.9, 0.99], "inner.lr": "1e-2"}
    spec = load_sweep(write_sweep(tmp_path, {"fixed": fixed, "grid": {"workers": [2]}}))
    (run,) = plan_sweep(spec, threads=1)
    assert run.config.logging.progress == "off" and run.config.inner.adamw.betas == (0.9, 0.99)
    assert run.config.inner.lr == 0.01
    assert load_config(QUICKSTART, run.overrides).to_dict() == run.config.to_dict()  # what `train` gets


# --- the sweep file -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"grid": {"workers": [1]}, "base": None}, "missing `base:`"),
        ({"base": "nope.yaml"}, "base config not found"),
        ({"grid": [1, 2]}, "grid must be a mapping"),
        ({"grid": {"workers": 4}}, "grid.workers must be a non-empty list"),
        ({"grid": {"workers": []}}, "grid.workers must be a non-empty list"),
        ({"grid": {"workers": [1, 1]}}, "lists a value twice"),
        (
            {"grid": {"workers": [1, 1], "sync.every": [5, 5]}, "zip": [["workers", "sync.every"]]},
            "same row twice",
        ),
        (
            {"grid": {"workers": [1, 2], "sync.every": [10]}, "zip": [["workers", "sync.every"]]},
            "same length",
        ),
        ({"grid": {"workers": [1, 2]}, "zip": [["workers", "nope"]]}, "zip key 'nope' is not in grid"),
        ({"grid": {"workers": [1, 2]}, "exclude": [{"wrkers": 1}]}, "exclude[0] key 'wrkers'"),
        ({"grid": {"workers": [1, 2]}, "exclude": {"workers": 1}}, "exclude must be a list"),
        ({"grdi": {"workers": [1]}}, "did you mean 'grid'"),
        ({"grid": {"workers": [1]}, "fixed": {"workers": 2}}, "both in fixed and in grid"),
        ({"grid": {"run.name": ["a", "b"]}}, "run.name is set by the sweep"),
        ({"baselines": "yes"}, "baselines must be 'auto'"),
        ({"name": "a/b"}, "plain directory name"),
    ],
)
def test_malformed_sweep_files_are_clear_errors(tmp_path, body, needle):
    body = {"base": str(QUICKSTART), **body}
    if body["base"] is None:
        del body["base"]
    with pytest.raises(ConfigError) as info:
        parse_sweep(body, tmp_path / "s.yaml")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_zipped_rows_may_repeat_a_value_each_method_at_its_own_lr(tmp_path):
    grid = {"inner.optimizer": ["adamw", "adamw", "muon"], "inner.lr": [0.003, 0.006, 0.02]}
    spec = parse_sweep({"base": str(QUICKSTART), "grid": grid, "zip": [list(grid)]}, tmp_path / "s.yaml")
    runs = expand_grid(spec.grid, spec.zip_groups)
    assert [(r["inner.optimizer"], r["inner.lr"]) for r in runs] == list(zip(*grid.values(), strict=True))
    assert len(set(run_names(runs))) == 3


def test_every_run_is_validated_before_anything_runs(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, {"grid": {"workers": [4, 3]}}))
    with pytest.raises(ConfigError, match="run workers=3: .*train.batch_tokens"):
        plan_sweep(spec, threads=1)
    spec = load_sweep(write_sweep(tmp_path, {"grid": {"inner.optimiser": ["muon"]}}))
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        plan_sweep(spec, threads=1)
    assert not (tmp_path / "out").exists()


def test_baselines_auto_adds_one_dp_run_per_optimizer_and_budget(tmp_path):
    spec = load_sweep(
        write_sweep(
            tmp_path,
            {
                "name": "h",
                "fixed": {"workers": 4, "compression.scheme": "statistical"},
                "grid": {"inner.optimizer": ["adamw", "muon"], "sync.every": [15, 30]},
                "baselines": "auto",
            },
        )
    )
    runs = plan_sweep(spec, threads=3)
    names = [r.name for r in runs]
    assert names == [
        "adamw_H15",
        "adamw_H30",
        "muon_H15",
        "muon_H30",
        "dp-baseline_adamw",
        "dp-baseline_muon",
    ]
    dp = runs[-1]
    assert dp.baseline and dp.config.method == "dp" and dp.config.compression.scheme == "none"
    assert dp.config.workers == 4 and dp.config.inner.optimizer == "muon"
    assert all(r.config.train.threads == 3 and r.config.logging.wandb_group == "h" for r in runs)
    assert runs[0].run_dir == tmp_path / "out" / "adamw_H15"


def test_baselines_are_not_added_twice_when_the_grid_has_the_dp_run(tmp_path):
    spec = load_sweep(
        write_sweep(tmp_path, {"grid": {"method": ["diloco", "dp"], "workers": [2, 4]}, "baselines": "auto"})
    )
    runs = plan_sweep(spec, threads=1)
    assert [r.name for r in runs] == ["diloco_w2", "diloco_w4", "dp_w2", "dp_w4"]


def test_each_seed_gets_its_own_baseline(tmp_path):
    grid = {"run.seed": [0, 1], "sync.every": [10, 20]}
    spec = load_sweep(write_sweep(tmp_path, {"grid": grid, "baselines": "auto"}))
    names = [r.name for r in plan_sweep(spec, threads=1)]
    assert names[-2:] == ["dp-baseline_seed0", "dp-baseline_seed1"] and len(names) == 6


def test_shipped_sweeps_plan(tmp_path):
    assert {p.name for p in SHIPPED} >= {"inner_optimizers.yaml", "quantization.yaml", "sync_interval.yaml"}
    counts = {p.stem: len(plan_sweep(load_sweep(p), threads=1)) for p in SHIPPED}
    assert counts["inner_optimizers"] == 16 and counts["quantization"] == 16 and counts["sync_interval"] == 10


# --- running and resuming (a fake launcher: no training) --------------------------------------------


class FakeProcess:
    def __init__(self, run_dir: Path, code: int):
        status = "completed" if code == 0 else "failed"
        (run_dir / "summary.json").write_text(json.dumps({"status": status, "final_val_loss": 1.0}))
        self.code = code

    def poll(self):
        return self.code


def test_resume_skips_completed_runs_and_reruns_failed_ones(tmp_path):
    spec = load_sweep(write_sweep(tmp_path, {"grid": {"workers": [1, 2, 4]}}))
    runs = plan_sweep(spec, threads=1)
    for run, status in zip(runs, ["completed", "failed"]):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "summary.json").write_text(json.dumps({"status": status}))
    launched = []

    def launch(spec, run, log_path):
        launched.append(run.name)
        return FakeProcess(run.run_dir, code=1 if run.name == "w2" else 0)

    result = run_sweep(spec, runs, jobs=2, launch=launch, poll_s=0)
    assert result.skipped == ["w1"] and launched == ["w2", "w4"]
    assert list(result.failed) == ["w2"] and "exit code 1" in result.failed["w2"]  # w4 ran all the same
    launched.clear()
    result = run_sweep(spec, runs, jobs=1, launch=launch, poll_s=0)
    assert launched == ["w2"] and result.skipped == ["w1", "w4"]


def test_a_failed_run_makes_the_sweep_exit_1_and_name_it(tmp_path, monkeypatch, caplog):
    import muloco.sweep

    def launch(spec, run, log_path):
        return FakeProcess(run.run_dir, code=1 if run.name == "w2" else 0)

    monkeypatch.setattr(muloco.sweep, "start_process", launch)
    path = write_sweep(tmp_path, {"grid": {"workers": [1, 2, 4]}})
    with caplog.at_level("INFO", logger="muloco"):
        assert muloco.sweep.sweep_main(path, jobs=3) == 1
    assert "failed=1: w2 (exit code 1" in caplog.text
    assert (tmp_path / "out" / "report.md").is_file()  # the report covers what finished


def test_an_unfinished_run_can_resume_with_another_thread_count(tmp_path):
    # train.threads is not part of the config fingerprint, so the checkpoint of a run planned with other
    # --jobs is still accepted.
    spec = load_sweep(write_sweep(tmp_path, {"grid": {"workers": [1, 2]}}))
    first = plan_sweep(spec, threads=2)
    run_dir = first[0].run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(first[0].config.to_yaml())
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    again = plan_sweep(spec, threads=1)
    assert again[0].config.train.threads == 1 and first[0].config.train.threads == 2
    assert again[0].config.fingerprint() == first[0].config.fingerprint()


# --- the CLI -------------------------------------------------------------------------------------------


def test_malformed_sweep_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"base": str(QUICKSTART), "grid": {"workers": [1, 2], "sync.every": [3]}}))
    path.write_text(path.read_text() + "zip: [[workers, sync.every]]\n")
    result = muloco("sweep", path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "same length" in lines[0]


def test_dry_run_lists_runs_and_runs_nothing(tmp_path, capsys):
    from muloco.cli import main

    path = write_sweep(tmp_path, {"grid": {"inner.optimizer": ["adamw", "muon"]}, "baselines": "auto"})
    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("adamw", "muon", "dp-baseline_adamw", "dp-baseline_muon"):
        assert f"  {name} " in out
    assert "inner.optimizer=muon" in out and "4 runs (2 DP baselines)" in out
    assert not (tmp_path / "out").exists()


def test_sweep_end_to_end_then_resume(tmp_path):
    fixed = {".".join(k): v for k, v in map(parse_override, TINY)}
    fixed["train.threads"] = 1  # a tiny model: more threads only contend (the machine may be busy)
    path = write_sweep(tmp_path, {"fixed": fixed, "grid": {"workers": [2]}, "baselines": "auto"})
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
