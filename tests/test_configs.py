"""Every shipped config validates; the quickstart accepts the overrides its comments advertise."""

from pathlib import Path

import pytest

from muloco.config import load_config
from muloco.sweep import load_sweep, plan_sweep

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path):
    load_config(path)


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["dp", "diloco"])
def test_quickstart_accepts_workers_and_method_overrides(workers, method):
    cfg = load_config(CONFIGS[0].parent / "quickstart.yaml", [f"workers={workers}", f"method={method}"])
    assert cfg.worker_batch_tokens * workers == cfg.train.batch_tokens


SWEEPS = sorted((CONFIGS[0].parent / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=[p.name for p in SWEEPS])
def test_shipped_sweep_plans(path):
    """Every run of every shipped sweep builds a valid config (what `muloco sweep --dry-run` checks)."""
    spec = load_sweep(path)
    runs = plan_sweep(spec, threads=1)
    assert runs and len({run.name for run in runs}) == len(runs)


def test_pico_regime_has_a_hundred_outer_steps():
    cfg = load_config(CONFIGS[0].parent / "pico.yaml")
    assert cfg.total_steps // cfg.sync.every == 100 and cfg.model.preset == "pico"
