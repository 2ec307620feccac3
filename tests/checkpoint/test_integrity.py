"""Damaged checkpoints never load silently: every checkpoint carries checksums of its content (plain: the
zip records' CRC-32s, checked before torch.load; sharded: DIGESTS of DCP's files), and a damaged newest one
is skipped like a torn one, with a warning naming it."""

import logging
import random
import warnings

import pytest
import torch

from muloco.checkpoint.plain import find_resume_state, load_checkpoint, save_checkpoint
from muloco.checkpoint.sharded import find_sharded, load_sharded, save_sharded
from muloco.comm.local import LocalBackend
from muloco.config import ModelConfig
from muloco.errors import CheckpointError
from muloco.models import build_model


def _run_like_state(seed: int = 0) -> dict:
    """What a run's checkpoint holds, in small: a model's weights, optimizer-like nested state, counters."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="nano", d_model=32, n_layers=2, n_heads=2, seq_len=32), 256)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {
        "replicas": [{"model": weights, "opt": {"momentum": [torch.randn(32, 32)], "step": 7}}],
        "progress": {"steps": 12, "tokens": 3072},
        "fingerprint": "abc123",
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _damage(path, rng: random.Random, length: int) -> None:
    data = bytearray(path.read_bytes())
    offset = rng.randrange(len(data))
    for i in range(offset, min(len(data), offset + length)):
        data[i] = rng.randrange(256)
    path.write_bytes(bytes(data))


def test_random_bytes_anywhere_in_a_checkpoint_never_load_silently(tmp_path):
    """Fuzz: 1 B to 4 KB of random bytes at a random offset, 300 times. Each damaged file is refused, or
    (bytes that fell in the zip headers' padding, outside every record) loads exactly the saved state."""
    state = _run_like_state()
    path = save_checkpoint(state, tmp_path, step=12, keep=1)
    original = path.read_bytes()
    saved = load_checkpoint(path)
    rng = random.Random(0)
    refused = 0
    for _ in range(300):
        path.write_bytes(original)
        _damage(path, rng, rng.choice([1, 8, 64, 4096]))
        try:
            loaded = load_checkpoint(path)
        except CheckpointError:
            refused += 1
            continue
        assert _equal(loaded, saved), "a damaged checkpoint loaded a different state"
    assert refused >= 270, refused  # padding is a small share of the file


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    """The issue's case: 4 KB of random bytes in the middle of the newest checkpoint."""
    older = save_checkpoint(_run_like_state(0), tmp_path, step=6, keep=2)
    newest = save_checkpoint(_run_like_state(1), tmp_path, step=12, keep=2)
    data = bytearray(newest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = random.Random(1).randbytes(4096)
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="muloco"):
        path, state = find_resume_state("auto", tmp_path)
    assert path == older
    assert _equal(state["replicas"], _run_like_state(0)["replicas"])
    assert str(newest) in caplog.text and "does not match its checksum" in caplog.text


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    for step in (6, 12):
        path = save_checkpoint(_run_like_state(step), tmp_path, step=step, keep=2)
        _damage(path, random.Random(step), 4096)
    with pytest.raises(CheckpointError, match="damaged|corrupt"):
        find_resume_state("auto", tmp_path)


def test_checksums_are_written_even_when_a_user_turned_them_off(tmp_path):
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        path = save_checkpoint(_run_like_state(), tmp_path, step=1, keep=1)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert _equal(load_checkpoint(path)["replicas"], _run_like_state()["replicas"])
    assert torch.serialization.get_crc32_options() == previous


def _save_sharded(directory, step: int, seed: int):
    state = _run_like_state(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")  # DCP without torch.distributed warns that it runs alone
        return save_sharded(state, directory, step, 2, LocalBackend(), "replica0", True, {"workers": 1})


def test_a_damaged_sharded_checkpoint_is_skipped_for_the_older_one(tmp_path, caplog):
    older = _save_sharded(tmp_path, 6, 0)
    newest = _save_sharded(tmp_path, 12, 1)
    assert find_sharded("auto", tmp_path, LocalBackend()) == newest
    data_file = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    _damage(data_file, random.Random(2), 64)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        assert find_sharded("auto", tmp_path, LocalBackend()) == older
    assert data_file.name in caplog.text and "does not match its digest" in caplog.text
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        state = load_sharded(older, "replica0", None)
    assert _equal(state["replicas"], _run_like_state(0)["replicas"])
    with pytest.raises(CheckpointError, match="does not match its digest"):
        find_sharded(str(newest), tmp_path, LocalBackend())  # named explicitly: refused, not loaded


def test_every_sharded_checkpoint_damaged_is_an_error(tmp_path):
    for step in (6, 12):
        path = _save_sharded(tmp_path, step, step)
        (path / ".metadata").write_bytes(b"\x00" + (path / ".metadata").read_bytes()[1:])
    with pytest.raises(CheckpointError, match="does not match its digest"):
        find_sharded("auto", tmp_path, LocalBackend())
