"""Every shipped config validates; the quickstart accepts the overrides its comments advertise."""

from pathlib import Path

import pytest

from muloco.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path):
    load_config(path)


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["dp", "diloco"])
def test_quickstart_accepts_workers_and_method_overrides(workers, method):
    cfg = load_config(CONFIGS[0].parent / "quickstart.yaml", [f"workers={workers}", f"method={method}"])
    assert cfg.worker_batch_tokens * workers == cfg.train.batch_tokens
