"""The builtin corpus builder: on a small fake stdlib tree, plus one build of the real stdlib."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from muloco.config import DataConfig
from muloco.data import builtin
from muloco.data.sources import load_data
from muloco.errors import DataError

VAL_FRACTION = 0.3


def _make_tree(root: Path) -> dict[str, bytes]:
    """A fake stdlib; returns the files that should make it into the corpus."""
    good = {f"m{i:02d}.py": f"x = {i}\n".encode() for i in range(40)}
    good |= {"pkg/__init__.py": b"", "pkg/mod.py": "caf\u00e9 = 1\n".encode(), "a.py": b"print('a')\n"}
    ignored = {
        "site-packages/foo.py": b"installed = True\n",
        "pkg/dist-packages/bar.py": b"installed = True\n",
        "notes.txt": b"not python\n",
        "bad.py": b"latin1 = '\xe9'\n",
        "nul.py": b"x = 1\x00\n",
    }
    for rel, data in (good | ignored).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return good


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "stdlib"
    return root, _make_tree(root)


def _expected(files: dict[str, bytes]) -> tuple[bytes, bytes]:
    train, val = b"", b""
    for rel in sorted(files):
        if builtin.is_val(rel, VAL_FRACTION):
            val += files[rel] + builtin.SEPARATOR
        else:
            train += files[rel] + builtin.SEPARATOR
    return train, val


def test_build_contents_sorted_split_and_exclusions(tree, tmp_path):
    root, good = tree
    assert builtin.list_source_files(root) == sorted([*good, "bad.py", "nul.py"])
    out = tmp_path / "out"
    out.mkdir()
    meta = builtin.build_corpus(out, root, VAL_FRACTION)
    train, val = _expected(good)
    assert train and val, "the fake tree must put files on both sides"
    assert (out / "train.bin").read_bytes() == train
    assert (out / "val.bin").read_bytes() == val
    assert meta["train_files"] + meta["val_files"] == len(good)
    assert sorted(s[0] for s in meta["skipped"]) == ["bad.py", "nul.py"]
    assert meta["train_bytes"] == len(train) and meta["val_bytes"] == len(val)


def test_build_is_deterministic(tree, tmp_path):
    root, _ = tree
    outs = [tmp_path / "one", tmp_path / "two"]
    metas = []
    for out in outs:
        out.mkdir()
        metas.append(builtin.build_corpus(out, root, VAL_FRACTION))
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    assert metas[0]["fingerprint"] == metas[1]["fingerprint"]


def test_split_hash_is_stable():
    # sha1-based: fixed across processes and machines (Python's hash() is salted per process).
    assert builtin.split_hash("os.py") == pytest.approx(0.968012, abs=1e-6)
    assert 0 <= builtin.split_hash("") < 1


def test_unreadable_file_is_skipped(tree, tmp_path, monkeypatch):
    root, good = tree
    real = builtin._read_bytes

    def read(path: Path) -> bytes:
        if path.name == "a.py":
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(builtin, "_read_bytes", read)
    out = tmp_path / "out"
    out.mkdir()
    meta = builtin.build_corpus(out, root, VAL_FRACTION)
    assert ["a.py", "unreadable (PermissionError)"] in meta["skipped"]
    assert meta["train_files"] + meta["val_files"] == len(good) - 1


def test_cache_is_built_once_and_reused(tree, tmp_path, monkeypatch, caplog):
    root, _ = tree
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="muloco.data"):
        first = builtin.ensure_builtin_corpus(cache, VAL_FRACTION, root)
    assert "built builtin corpus files=" in caplog.text and "seconds=" in caplog.text
    assert first.parent == cache and first.name.startswith(builtin.cache_key(VAL_FRACTION).split("-val")[0])
    assert sorted(p.name for p in first.iterdir()) == ["meta.json", "train.bin", "val.bin"]

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached corpus")

    monkeypatch.setattr(builtin, "build_corpus", no_build)
    assert builtin.ensure_builtin_corpus(cache, VAL_FRACTION, root) == first
    assert [p.name for p in cache.iterdir()] == [first.name], "no temp dirs left behind"


def test_cache_key_names_python_and_val_fraction():
    key = builtin.cache_key(0.05)
    assert key.startswith("builtin-py3.") and key.endswith("-v1-val0.05")


def test_losing_the_race_uses_the_winners_copy(tree, tmp_path, monkeypatch, caplog):
    root, _ = tree
    cache = tmp_path / "cache"
    final = cache / builtin.cache_key(VAL_FRACTION, root)
    real_build = builtin.build_corpus

    def build_while_another_process_wins(out, root_, val_fraction):
        final.mkdir(parents=True)
        real_build(final, root_, val_fraction)  # the other process publishes first
        (final / "winner").write_text("")
        return real_build(out, root_, val_fraction)

    monkeypatch.setattr(builtin, "build_corpus", build_while_another_process_wins)
    with caplog.at_level(logging.INFO, logger="muloco.data"):
        got = builtin.ensure_builtin_corpus(cache, VAL_FRACTION, root)
    assert got == final and (final / "winner").exists()
    assert "built builtin corpus" not in caplog.text
    assert [p.name for p in cache.iterdir()] == [final.name], "our temp dir was removed"


def test_damaged_cache_is_rebuilt(tree, tmp_path):
    root, good = tree
    cache = tmp_path / "cache"
    final = builtin.ensure_builtin_corpus(cache, VAL_FRACTION, root)
    (final / "train.bin").write_bytes(b"truncated")
    assert builtin.read_meta(final) is None
    again = builtin.ensure_builtin_corpus(cache, VAL_FRACTION, root)
    assert again == final and (final / "train.bin").read_bytes() == _expected(good)[0]
    assert [p.name for p in cache.iterdir()] == [final.name]


def test_unwritable_cache_dir_is_a_data_error(tree, tmp_path):
    root, _ = tree
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match="data.cache_dir") as err:
        builtin.ensure_builtin_corpus(blocker / "cache", VAL_FRACTION, root)
    assert "\n" not in str(err.value)


# --- the real stdlib, built once for this module --------------------------------------------------------


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("muloco-cache")


def test_real_stdlib_corpus(real_cache):
    data = load_data(DataConfig(source="builtin", cache_dir=str(real_cache)), seq_len=256)
    assert data.vocab_size == 256 and data.train.dtype == np.uint8 and data.val.dtype == np.uint8
    assert isinstance(data.train, np.memmap) and not data.train.flags.writeable
    corpus_dir = real_cache / builtin.cache_key(0.05)
    meta = json.loads((corpus_dir / "meta.json").read_text())
    files = meta["train_files"] + meta["val_files"]
    assert files > 500 and len(data.train) > 5_000_000 and len(data.val) > 100_000
    assert 0.02 < meta["val_files"] / files < 0.08  # about val_fraction of the files
    assert meta["python_version"] in data.description
    listed = builtin.list_source_files(builtin.stdlib_root())
    assert not any("site-packages" in p for p in listed)
    # Reopening hits the cache.
    again = load_data(DataConfig(source="builtin", cache_dir=str(real_cache)), seq_len=256)
    assert np.array_equal(again.val, data.val)
