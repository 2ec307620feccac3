"""data.source tokens and text, load_data dispatch, and the one-line DataErrors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from muloco.config import DataConfig
from muloco.data import builtin, sources
from muloco.data.sources import TokenData, load_data
from muloco.errors import DataError

SEP = builtin.SEPARATOR


def _raises(cfg: DataConfig, seq_len: int, *needles: str) -> str:
    with pytest.raises(DataError) as err:
        load_data(cfg, seq_len)
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# --- tokens -----------------------------------------------------------------------------------------


def _write_tokens(directory: Path, train: np.ndarray, val: np.ndarray) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    train.tofile(directory / "train.bin")
    val.tofile(directory / "val.bin")
    return directory


def _tokens_cfg(path: Path, vocab_size: int = 1000, dtype: str = "uint16") -> DataConfig:
    return DataConfig(source="tokens", path=str(path), vocab_size=vocab_size, dtype=dtype)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_source_opens_memmaps(tmp_path, dtype):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, 5000).astype(dtype)
    val = rng.integers(0, 1000, 600).astype(dtype)
    data = load_data(_tokens_cfg(_write_tokens(tmp_path / "d", train, val), dtype=dtype), seq_len=64)
    assert isinstance(data, TokenData) and data.vocab_size == 1000
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.dtype(dtype)
    assert np.array_equal(data.train, train) and np.array_equal(data.val, val)
    assert str(tmp_path / "d") in data.description


def test_tokens_errors(tmp_path):
    ok = np.arange(500, dtype=np.uint16)
    _raises(_tokens_cfg(tmp_path / "missing"), 8, "data.path", "does not exist")
    (tmp_path / "afile").write_text("")
    _raises(_tokens_cfg(tmp_path / "afile"), 8, "data.path", "not a directory")

    d = tmp_path / "no_train"
    d.mkdir()
    ok.tofile(d / "val.bin")
    _raises(_tokens_cfg(d), 8, "data.path", "train.bin", "missing")

    d = tmp_path / "no_val"
    d.mkdir()
    ok.tofile(d / "train.bin")
    _raises(_tokens_cfg(d), 8, "data.path", "val.bin", "missing")

    d = _write_tokens(tmp_path / "odd", ok, ok)
    (d / "train.bin").write_bytes(ok.tobytes() + b"\x01")
    _raises(_tokens_cfg(d), 8, "data.path", "train.bin", "not a multiple of 2", "data.dtype")

    d = _write_tokens(tmp_path / "empty", ok, ok)
    (d / "val.bin").write_bytes(b"")
    _raises(_tokens_cfg(d), 8, "data.path", "val.bin", "empty")

    d = _write_tokens(tmp_path / "vocab", ok, np.array([1, 2, 1000, 3] * 10, dtype=np.uint16))
    _raises(_tokens_cfg(d, vocab_size=1000), 8, "data.path", "val.bin", "token id 1000", "data.vocab_size")

    d = _write_tokens(tmp_path / "small", ok, ok[:8])
    _raises(_tokens_cfg(d), 8, "data.path", "val split has 8 tokens", "model.seq_len=8", "at least 9")
    _raises(_tokens_cfg(d), 500, "data.path", "train split has 500 tokens", "model.seq_len=500")

    no_vocab = DataConfig(source="tokens", path=str(tmp_path / "odd"))
    _raises(no_vocab, 8, "data.vocab_size")
    _raises(DataConfig(source="tokens", path=[str(d), str(d)], vocab_size=1000), 8, "data.path")


# --- text -------------------------------------------------------------------------------------------


def _text_cfg(path, val_fraction: float = 0.3) -> DataConfig:
    return DataConfig(source="text", path=path, val_fraction=val_fraction)


def _make_docs(root: Path, n: int = 30) -> dict[str, bytes]:
    files = {f"sub{i % 3}/doc{i:02d}.txt": f"document {i} " * 5 for i in range(n)}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return {rel: text.encode() for rel, text in files.items()}


def _expected_split(files: dict[str, bytes], val_fraction: float) -> tuple[bytes, bytes]:
    train = b"".join(d + SEP for k, d in sorted(files.items()) if not builtin.is_val(k, val_fraction))
    val = b"".join(d + SEP for k, d in sorted(files.items()) if builtin.is_val(k, val_fraction))
    return train, val


def test_text_single_file_split_by_bytes(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("h\u00e9llo world " * 100, encoding="utf-8")
    data = load_data(_text_cfg(str(f), val_fraction=0.1), seq_len=16)
    raw = f.read_bytes() + SEP
    assert data.vocab_size == 256 and data.train.dtype == np.uint8
    assert bytes(data.train) + bytes(data.val) == raw
    assert len(data.val) == round(len(raw) * 0.1)
    assert "split by bytes" in data.description


def test_text_directory_split_by_file_and_location_independent(tmp_path):
    files = _make_docs(tmp_path / "a")
    (tmp_path / "a" / ".hidden").write_text("skip me")
    (tmp_path / "a" / ".git").mkdir()
    (tmp_path / "a" / ".git" / "HEAD").write_text("skip me too")
    data = load_data(_text_cfg(str(tmp_path / "a")), seq_len=8)
    train, val = _expected_split(files, 0.3)
    assert train and val
    assert bytes(data.train) == train and bytes(data.val) == val
    # The same files elsewhere give the same split: keys are relative to the named directory.
    _make_docs(tmp_path / "elsewhere" / "deeper")
    moved = load_data(_text_cfg(str(tmp_path / "elsewhere" / "deeper")), seq_len=8)
    assert bytes(moved.train) == train and bytes(moved.val) == val


def test_text_glob_and_list(tmp_path):
    files = _make_docs(tmp_path)
    by_glob = load_data(_text_cfg(str(tmp_path / "sub*" / "*.txt")), seq_len=8)
    train, val = _expected_split(files, 0.3)
    assert bytes(by_glob.train) == train and bytes(by_glob.val) == val

    entries = [str(tmp_path / "sub0"), str(tmp_path / "sub1" / "doc01.txt"), str(tmp_path / "sub2" / "*.txt")]
    expanded = sources.expand_text_paths(entries + [str(tmp_path / "sub0")])  # the repeat is dropped
    names = [f.relative_to(tmp_path).as_posix() for _, f in expanded]
    assert names == sorted(k for k in files if k.startswith("sub0")) + ["sub1/doc01.txt"] + sorted(
        k for k in files if k.startswith("sub2")
    )
    assert [key for key, _ in expanded][0] == "doc00.txt"  # relative to the named directory
    by_list = load_data(_text_cfg(entries), seq_len=8)
    assert len(by_list.train) + len(by_list.val) == sum(len(files[n]) + 1 for n in names)


def test_text_errors(tmp_path, monkeypatch):
    _raises(_text_cfg(str(tmp_path / "nope.txt")), 8, "data.path", "matches no files")
    _raises(_text_cfg(str(tmp_path / "*.md")), 8, "data.path", "matches no files")
    (tmp_path / "empty").mkdir()
    _raises(_text_cfg(str(tmp_path / "empty")), 8, "data.path", "matches no files")
    (tmp_path / "empty" / "a.txt").write_text("")
    _raises(_text_cfg(str(tmp_path / "empty")), 8, "data.path", "0 bytes")

    bad = tmp_path / "bad" / "latin1.txt"
    bad.parent.mkdir()
    bad.write_bytes(b"caf\xe9")
    _raises(_text_cfg(str(bad.parent)), 8, "data.path", "latin1.txt", "not UTF-8")

    locked = tmp_path / "locked.txt"
    locked.write_text("secret " * 100)
    real_read = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    _raises(_text_cfg(str(locked)), 8, "data.path", "locked.txt", "Permission denied")

    short = tmp_path / "short.txt"
    short.write_text("tiny")
    _raises(_text_cfg(str(short)), 64, "data.path", "too small for model.seq_len=64")
    _raises(DataConfig(source="text", path=str(short), vocab_size=100), 1, "data.vocab_size")


def test_byte_sources_accept_a_padded_vocab(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc " * 200)
    assert load_data(DataConfig(source="text", path=str(f), vocab_size=512), seq_len=8).vocab_size == 512
