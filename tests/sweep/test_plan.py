"""muloco/sweep/plan.py: every run validated up front, DP baselines, overrides `muloco train` reads back."""

import json
from pathlib import Path

import pytest

from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.sweep.plan import _read_back, override_text, plan_sweep
from muloco.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SHIPPED = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


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


def test_values_mean_what_they_mean_in_a_config_file(write_sweep):
    # `off` is YAML's False; in a config file the schema reads it as "off", and so does a sweep.
    fixed = {"logging.progress": False, "inner.adamw.betas": [0.9, 0.99], "inner.lr": "1e-2"}
    spec = load_sweep(write_sweep({"fixed": fixed, "grid": {"workers": [2]}}))
    (run,) = plan_sweep(spec, threads=1)
    assert run.config.logging.progress == "off" and run.config.inner.adamw.betas == (0.9, 0.99)
    assert run.config.inner.lr == 0.01
    assert load_config(QUICKSTART, run.overrides).to_dict() == run.config.to_dict()  # what `train` gets


def test_mapping_values_model_hf_and_kwargs_pass_as_one_override(write_sweep):
    hf = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}
    spec = load_sweep(write_sweep({"fixed": {"model.hf": hf}, "grid": {"workers": [1, 2]}}))
    runs = plan_sweep(spec, threads=1)
    assert all(run.config.model.hf == hf for run in runs)
    assert any(o.startswith("model.hf={") for o in runs[0].overrides)
    assert load_config(QUICKSTART, runs[0].overrides).to_dict() == runs[0].config.to_dict()
    grid = {"model.kwargs": [{"width": 8}, {"width": 16}]}
    spec = load_sweep(write_sweep({"fixed": {"model.factory": "m:f"}, "grid": grid}))
    assert [run.config.model.kwargs for run in plan_sweep(spec, threads=1)] == grid["model.kwargs"]


def test_every_run_is_validated_before_anything_runs(tmp_path, write_sweep):
    spec = load_sweep(write_sweep({"grid": {"workers": [4, 3]}}))
    with pytest.raises(ConfigError, match="run workers=3: .*train.batch_tokens"):
        plan_sweep(spec, threads=1)
    spec = load_sweep(write_sweep({"grid": {"inner.optimiser": ["muon"]}}))
    with pytest.raises(ConfigError, match="did you mean 'optimizer'"):
        plan_sweep(spec, threads=1)
    spec = load_sweep(
        write_sweep({"grid": {"inner.optimizer": ["muon", "lino"]}})
    )  # a misspelt catalogue name
    with pytest.raises(ConfigError, match="unknown optimizer 'lino'; did you mean lion"):
        plan_sweep(spec, threads=1)
    assert not (tmp_path / "out").exists()


def test_any_inner_optimizer_and_its_kwargs_are_grid_values(write_sweep):
    grid = {"inner.optimizer": ["muon", "lion", "NAdam"], "inner.kwargs": [{}, {"weight_decay": 0.1}]}
    exclude = [{"inner.optimizer": "muon", "inner.kwargs": {"weight_decay": 0.1}}]
    spec = load_sweep(write_sweep({"grid": grid, "exclude": exclude, "baselines": "none"}))
    runs = plan_sweep(spec, threads=1)
    assert [(r.config.inner.optimizer, r.config.inner.kwargs) for r in runs] == [
        ("muon", {}),
        ("lion", {}),
        ("lion", {"weight_decay": 0.1}),
        ("NAdam", {}),
        ("NAdam", {"weight_decay": 0.1}),
    ]
    assert all(load_config(QUICKSTART, r.overrides).to_dict() == r.config.to_dict() for r in runs)


def test_baselines_auto_adds_one_dp_run_per_optimizer_and_budget(tmp_path, write_sweep):
    spec = load_sweep(
        write_sweep(
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


def test_baselines_are_not_added_twice_when_the_grid_has_the_dp_run(write_sweep):
    grid = {"method": ["diloco", "dp"], "workers": [2, 4]}
    spec = load_sweep(write_sweep({"grid": grid, "baselines": "auto"}))
    runs = plan_sweep(spec, threads=1)
    assert [r.name for r in runs] == ["diloco_w2", "diloco_w4", "dp_w2", "dp_w4"]


def test_each_seed_gets_its_own_baseline(write_sweep):
    grid = {"run.seed": [0, 1], "sync.every": [10, 20]}
    spec = load_sweep(write_sweep({"grid": grid, "baselines": "auto"}))
    names = [r.name for r in plan_sweep(spec, threads=1)]
    assert names[-2:] == ["dp-baseline_seed0", "dp-baseline_seed1"] and len(names) == 6


def test_shipped_sweeps_plan():
    assert {p.name for p in SHIPPED} >= {"inner_optimizers.yaml", "quantization.yaml", "sync_interval.yaml"}
    counts = {p.stem: len(plan_sweep(load_sweep(p), threads=1)) for p in SHIPPED}
    assert counts["quickstart_workers"] == counts["quantization"] == 16 and counts["sync_interval"] == 10
    assert counts["inner_optimizers"] == 152  # 19 (optimizer, lr) rows x (K = 1, 4, 8 + DP) x 2 seeds


def test_an_unfinished_run_can_resume_with_another_thread_count(write_sweep):
    # train.threads is not part of the config fingerprint, so the checkpoint of a run planned with other
    # --jobs is still accepted.
    spec = load_sweep(write_sweep({"grid": {"workers": [1, 2]}}))
    first = plan_sweep(spec, threads=2)
    run_dir = first[0].run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(first[0].config.to_yaml())
    (run_dir / "summary.json").write_text(json.dumps({"status": "interrupted"}))
    again = plan_sweep(spec, threads=1)
    assert again[0].config.train.threads == 1 and first[0].config.train.threads == 2
    assert again[0].config.fingerprint() == first[0].config.fingerprint()
