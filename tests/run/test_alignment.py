"""Pseudogradient alignment diagnostics (muloco/run/alignment.py)."""

import json
import math
from pathlib import Path

import pytest
import torch

from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.run.alignment import alignment_stats, effective_rank, flat_cosine
from muloco.run.trainer import Trainer


def test_effective_rank_of_rank_one_and_flat_spectra():
    assert effective_rank(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert effective_rank(torch.ones(8)) == pytest.approx(8.0)


def test_identical_workers_agree_fully():
    delta = [torch.randn(6, 4), torch.randn(4)]
    stats = alignment_stats([delta, delta, delta], delta, matrices=[0])
    for key in ("cos_to_union", "mean_cos_to_union", "norm_retention", "top_sv_retention"):
        assert stats[key] == pytest.approx(1.0, abs=1e-6), key
    assert stats["erank_mean"] == pytest.approx(stats["erank_workers"])


def test_orthogonal_workers_keep_one_over_sqrt_k_of_their_norm():
    K = 4
    deltas = [[torch.eye(K)[k].reshape(2, 2)] for k in range(K)]  # orthogonal, equal norms
    union = [torch.ones(2, 2)]  # the sum direction
    stats = alignment_stats(deltas, union, matrices=[0])
    assert stats["norm_retention"] == pytest.approx(1 / math.sqrt(K))
    assert stats["cos_to_union"] == pytest.approx(flat_cosine(deltas[0], union)) == pytest.approx(0.5)
    assert stats["mean_cos_to_union"] == pytest.approx(1.0)


def _sync_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "sync"]


def test_one_worker_and_its_probe_take_the_same_steps(tiny):
    # K = 1: the union of the workers' batches is the worker's batch, so the probe repeats its steps.
    cfg = load_config(None, [*tiny, "workers=1", "diagnostics.alignment=true", "run.name=probe_k1"])
    Trainer(cfg).run()
    records = _sync_records(Path(cfg.run.output_dir) / "probe_k1")
    assert len(records) == cfg.total_steps // cfg.sync.every
    for record in records:
        assert record["cos_to_union"] == pytest.approx(1.0, abs=1e-5)
        assert record["norm_retention"] == pytest.approx(1.0, abs=1e-6)


def test_alignment_is_logged_at_every_sync_and_leaves_the_run_unchanged(tiny):
    args = [*tiny, "workers=4", "train.batch_tokens=512"]
    plain = Trainer(load_config(None, [*args, "run.name=plain"]))
    plain.run()
    cfg = load_config(None, [*args, "diagnostics.alignment=true", "run.name=probed"])
    probed = Trainer(cfg)
    probed.run()
    for a, b in zip(plain.engine.outer.params, probed.engine.outer.params, strict=True):
        assert torch.equal(a, b)  # the probe reads its own copies of the streams
    for record in _sync_records(Path(cfg.run.output_dir) / "probed"):
        assert -1 <= record["cos_to_union"] <= 1 and 0 < record["norm_retention"] <= 1
        assert 0 < record["erank_mean"] <= 1 and 0 < record["top_sv_retention"] <= 1 + 1e-6


@pytest.mark.parametrize("extra", [["method=dp"], ["sync.fragments=2"], ["backend.kind=torch"]])
def test_alignment_needs_a_plain_simulated_run(tiny, extra):
    with pytest.raises(ConfigError, match="diagnostics.alignment"):
        load_config(None, [*tiny, "diagnostics.alignment=true", *extra])
