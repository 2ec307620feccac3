"""The run's counters as components (run_state.py) and the checkpoint made of them (format version 2)."""

import dataclasses

import pytest
import torch

from muloco.checkpoint.plain import FORMAT_VERSION, load_checkpoint, save_checkpoint
from muloco.config import load_config
from muloco.errors import CheckpointError
from muloco.net.wan import Link
from muloco.run.trainer import Trainer
from muloco.sync.counters import CommLedger, Progress, WanProjection


def test_every_field_is_saved_and_restored():
    progress = Progress(steps=7, outer_steps=2, fragment_syncs=6, bad_syncs=1, round_losses=[1.5])
    progress.val_losses.append([7, 2.25])
    restored = Progress()
    restored.load_state_dict(progress.state_dict())
    assert restored == progress
    ledger = CommLedger(num_params=10, bytes_sent=3.0, peak_bytes_per_sync=2.0, payload_by_fragment={1: 5.0})
    again = CommLedger(num_params=10)
    again.load_state_dict(ledger.state_dict())
    assert again == ledger and again.summary()["effective_bits_per_param"] == 4.0


def test_a_new_counter_is_one_field():
    @dataclasses.dataclass
    class WithRetries(Progress):
        retries: int = 0

    state = WithRetries(retries=3).state_dict()
    assert state["retries"] == 3
    fresh = WithRetries()
    fresh.load_state_dict(state)
    assert fresh.retries == 3
    with pytest.raises(CheckpointError, match=r"lacks WithRetries fields \['retries'\]"):
        fresh.load_state_dict(Progress().state_dict())


def test_an_optional_counter_keeps_its_default_in_an_older_checkpoint():
    ledger = CommLedger(num_params=10)
    ledger.count(8.0, own=4.0)  # a rank of a sharded worker: the worker sent 8, this rank 4
    ledger.count(2.0)
    assert (ledger.bytes_sent, ledger.rank_bytes_sent) == (10.0, 6.0)
    older = {k: v for k, v in ledger.state_dict().items() if k != "rank_bytes_sent"}
    restored = CommLedger(num_params=10)
    restored.load_state_dict(older)
    assert restored.bytes_sent == 10.0 and restored.rank_bytes_sent == 0.0


def test_wiring_is_not_state_and_the_projection_hides_overlapped_transfers():
    progress = Progress(steps=10, worker_compute_s=5.0)  # 0.5 s a step
    wan = WanProjection(link=Link(100.0), progress=progress)
    assert set(wan.state_dict()) == {"network_s", "wait_s"}
    wan.project(2.0, overlap_steps=3)  # 1.5 s hidden behind 3 steps
    assert wan.network_s == 2.0 and wan.wait_s == pytest.approx(0.5)
    assert wan.summary()["projected_wall_s"] == 5.5
    assert WanProjection(progress=progress).summary() == {}


def test_a_checkpoint_is_one_entry_per_component(tiny):
    trainer = Trainer(load_config(None, [*tiny, "workers=2", "train.batch_tokens=512"]))
    trainer.run()
    state = load_checkpoint(trainer.save_checkpoint())
    assert state["format"] == FORMAT_VERSION == 2
    assert set(trainer.components) == {
        "progress",
        "ledger",
        "wan",
        "clock",
        "pacing",
        "replicas",
        "rng",
        "engine",
    }
    assert set(state) == {"format", "fingerprint", "local_indices", *trainer.components}
    assert state["progress"]["steps"] == trainer.progress.steps == trainer.total_steps
    assert state["ledger"]["bytes_sent"] == trainer.ledger.bytes_sent > 0


def test_a_checkpoint_of_another_format_version_names_the_versions(tmp_path):
    save_checkpoint({"progress": {}}, tmp_path, 3, keep=1)
    path = tmp_path / "step_00000003.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "format": 1}, path)
    with pytest.raises(CheckpointError, match="has format version 1, this muloco reads version 2"):
        load_checkpoint(path)
