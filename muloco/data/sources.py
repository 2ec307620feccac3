"""Data sources: `data.source` (builtin | tokens | text) -> `TokenData` (train and val token arrays).

- builtin: the cached stdlib corpus of builtin.py, read-only uint8 memmaps, vocab 256.
- tokens: nanoGPT-style flat memmaps `train.bin` / `val.bin` in the directory `data.path`, dtype
  `data.dtype`, vocab `data.vocab_size`; both default to the directory's `meta.json` (`muloco data
  prepare`), which may also name the tokenizer.json that made the ids.
- text: UTF-8 files (a file, directory, glob, or a list of them), byte-level, vocab 256, read into memory;
  split by file hash like builtin, or by bytes when the files do not fall on both sides.

Every problem with the user's data is a `DataError`: one line naming the field or file and the fix.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from muloco.config import DataConfig
from muloco.data import builtin
from muloco.errors import DataError

META_FILE = "meta.json"  # written by `muloco data prepare` (prepare.py)
VOCAB_CHECK_TOKENS = 1 << 24  # token ids checked against data.vocab_size: the first 16M of each split


@dataclass(frozen=True, eq=False)
class TokenData:
    """The token ids of a run: 1-D integer arrays (numpy arrays or read-only memmaps)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str  # one line for logs
    # How the ids decode: "byte" (UTF-8 bytes), "tokenizer.json" (tokenizer_file, data prepare's BPE) or
    # "unknown" (token files without a meta.json).
    tokenizer: str = "byte"
    tokenizer_file: Path | None = None


def load_data(cfg: DataConfig, seq_len: int) -> TokenData:
    """Open the source named by `cfg.source`; both splits must hold at least one sequence (seq_len + 1)."""
    if cfg.source == "builtin":
        data = load_builtin(cfg)
        where = "data.source=builtin"
    elif cfg.source == "tokens":
        data = load_tokens(cfg)
        where = f"data.path: {cfg.path}"
    elif cfg.source == "text":
        data = load_text(cfg)
        where = f"data.path: {cfg.path}"
    else:
        raise DataError(f"data.source: unknown source {cfg.source!r}; use builtin, tokens or text")
    for split, tokens in (("train", data.train), ("val", data.val)):
        if len(tokens) < seq_len + 1:
            hint = " or raise data.val_fraction" if split == "val" and cfg.source != "tokens" else ""
            raise DataError(
                f"{where}: the {split} split has {len(tokens)} tokens and is too small for "
                f"model.seq_len={seq_len}, need at least {seq_len + 1} tokens; "
                f"add data, lower model.seq_len{hint}"
            )
    return data


def _byte_vocab(cfg: DataConfig) -> int:
    """Byte-level sources use 256 ids; a larger data.vocab_size pads the embedding (unused ids)."""
    if cfg.vocab_size is not None and cfg.vocab_size < builtin.VOCAB_SIZE:
        raise DataError(
            f"data.vocab_size={cfg.vocab_size} is too small for byte-level data.source: {cfg.source} "
            f"(256 byte values); remove data.vocab_size or set it to at least 256"
        )
    return cfg.vocab_size or builtin.VOCAB_SIZE


def _mtok(n: int) -> str:
    """A token count in the unit that fits its size: 512, 20.5k, 1.25M, 2.10B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)


# --- builtin ----------------------------------------------------------------------------------------


def load_builtin(cfg: DataConfig) -> TokenData:
    train, val, meta = builtin.open_builtin_corpus(cfg.cache_dir, cfg.val_fraction)
    files = meta["train_files"] + meta["val_files"]
    description = (
        f"builtin corpus (Python {meta['python_version']} stdlib, {files} files, "
        f"train={_mtok(len(train))} val={_mtok(len(val))} byte tokens, "
        f"fingerprint={meta['fingerprint'][:12]})"
    )
    return TokenData(train, val, _byte_vocab(cfg), description)


# --- tokens -----------------------------------------------------------------------------------------


def _open_token_file(path: Path, dtype: np.dtype, vocab_size: int) -> np.memmap:
    fix = "write it with `muloco data prepare` or a nanoGPT-style prepare script (flat token ids)"
    if not path.is_file():
        raise DataError(f"data.path: {path} is missing; {fix}")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"data.path: {path} is empty; regenerate it")
    if size % dtype.itemsize:
        raise DataError(
            f"data.path: {path} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"(dtype {dtype.name}); check data.dtype or regenerate the file"
        )
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as exc:
        raise DataError(f"data.path: cannot read {path} ({exc.strerror}); fix its permissions") from None
    top = int(tokens[:VOCAB_CHECK_TOKENS].max())  # one cheap pass; a full scan of a large file is not
    if top >= vocab_size:
        raise DataError(
            f"data.path: {path} holds token id {top} >= the vocabulary size {vocab_size}; "
            f"set data.vocab_size to at least {top + 1} (or check data.dtype)"
        )
    return tokens


def read_token_meta(directory: Path) -> dict | None:
    """`meta.json` of a directory written by `muloco data prepare` (prepare.py), or None without one."""
    path = directory / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        vocab, dtype = int(meta["vocab_size"]), str(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"data.path: {path} is not a valid meta.json ({type(exc).__name__}: {exc}); "
            "rerun `muloco data prepare` or delete it and set data.vocab_size"
        ) from None
    if dtype not in ("uint16", "uint32") or vocab < 1 or meta["vocab_size"] != vocab:
        raise DataError(
            f"data.path: {path} names dtype {dtype!r} and vocab {vocab}; rerun `muloco data prepare`"
        )
    return meta


def _agree(cfg_value, meta_value, field: str, meta_path: Path, at_least: bool = False):
    """The config's value when set (it must match meta.json's, or with `at_least` not be below it: a
    padded vocabulary), else meta.json's."""
    if cfg_value is None or meta_value is None:
        return cfg_value if cfg_value is not None else meta_value
    if cfg_value == meta_value or (at_least and cfg_value > meta_value):
        return cfg_value
    hint = f"set it >= {meta_value} or remove it" if at_least else "remove it from the config"
    raise DataError(f"data.{field}={cfg_value} but {meta_path} says {meta_value}; {hint}")


def load_tokens(cfg: DataConfig) -> TokenData:
    paths = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path or [])
    if len(paths) != 1:
        raise DataError(
            f"data.path: {cfg.path!r} must be one directory holding train.bin and val.bin "
            "for data.source: tokens"
        )
    directory = Path(paths[0]).expanduser()
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.is_file() else "does not exist"
        raise DataError(
            f"data.path: {directory} {what}; point it at a directory holding train.bin and val.bin"
        )
    meta = read_token_meta(directory) or {}
    meta_path = directory / META_FILE
    vocab_size = _agree(cfg.vocab_size, meta.get("vocab_size"), "vocab_size", meta_path, at_least=True)
    dtype_name = _agree(cfg.dtype, meta.get("dtype"), "dtype", meta_path) or "uint16"
    if vocab_size is None:
        raise DataError(
            f"data.vocab_size is required for data.source: tokens without {meta_path}; set it to the "
            "tokenizer's vocabulary size (or prepare the data with `muloco data prepare`)"
        )
    dtype = np.dtype(dtype_name)
    train = _open_token_file(directory / "train.bin", dtype, vocab_size)
    val = _open_token_file(directory / "val.bin", dtype, vocab_size)
    tokenizer = str(meta.get("tokenizer", "unknown"))
    tokenizer_file = directory / tokenizer if tokenizer not in ("byte", "unknown") else None
    if tokenizer_file is not None and not tokenizer_file.is_file():
        raise DataError(
            f"data.path: {meta_path} names {tokenizer_file}, which is missing; rerun data prepare"
        )
    description = (
        f"tokens {directory} ({dtype_name}, vocab {vocab_size}, train={_mtok(len(train))} "
        f"val={_mtok(len(val))} tokens)"
    )
    kind = "tokenizer.json" if tokenizer_file is not None else tokenizer
    return TokenData(train, val, vocab_size, description, tokenizer=kind, tokenizer_file=tokenizer_file)


# --- text -------------------------------------------------------------------------------------------


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _walk_files(directory: Path) -> list[Path]:
    """All files under directory, recursively, sorted; hidden files and directories (".x") skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _glob_base(pattern: str) -> Path:
    """The leading directories of a glob pattern that hold no wildcard: split keys are relative to it."""
    parts = Path(pattern).parts
    static = []
    for part in parts[:-1]:
        if _has_magic(part):
            break
        static.append(part)
    return Path(*static) if static else Path(".")


def expand_text_paths(path: str | list[str], field: str = "data.path") -> list[tuple[str, Path]]:
    """(split key, file) for every file named by data.path, in order, without duplicates.

    The split key is the path relative to the directory (or glob prefix) the user named, or the file name for
    a plain file, so the train/val split does not depend on where the data lives on each machine.
    """
    entries = [path] if isinstance(path, str) else list(path)
    if not entries:
        raise DataError(f"{field} is an empty list; name text files, directories or globs")
    out: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for entry in entries:
        entry = os.path.expanduser(entry)
        if _has_magic(entry):
            base = _glob_base(entry)
            found = []
            for match in sorted(glob.glob(entry, recursive=True)):
                match = Path(match)
                if match.is_dir():
                    found += [(f.relative_to(base).as_posix(), f) for f in _walk_files(match)]
                elif match.is_file():
                    found.append((match.relative_to(base).as_posix(), match))
        elif Path(entry).is_dir():
            found = [(f.relative_to(entry).as_posix(), f) for f in _walk_files(Path(entry))]
        elif Path(entry).is_file():
            found = [(Path(entry).name, Path(entry))]
        else:
            found = []
        if not found:
            raise DataError(
                f"{field}: {entry!r} matches no files; check the path (a file, directory or glob)"
            )
        for key, file in found:
            resolved = file.resolve()
            if resolved not in seen:
                seen.add(resolved)
                out.append((key, file))
    return out


def read_text_file(file: Path, field: str = "data.path") -> bytes:
    """The file's bytes, checked to be UTF-8; a DataError naming `field` and the file otherwise."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise DataError(
            f"{field}: cannot read {file} ({exc.strerror}); fix its permissions or leave it out of {field}"
        ) from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{field}: {file} is not UTF-8 text (bad byte at offset {exc.start}); "
            f"convert it or leave it out of {field}"
        ) from None
    return data


def split_text_files(
    files: list[tuple[str, Path]], val_fraction: float
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train bytes, val bytes, train files, val files): split by file hash like builtin, else by bytes.

    Each file is followed by the separator byte (builtin.SEPARATOR). When every file falls on one side (one
    file, or few files), the concatenation is cut instead: the last val_fraction of its bytes go to val.
    """
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for key, file in files:
        data = read_text_file(file)
        parts["val" if builtin.is_val(key, val_fraction) else "train"] += [data, builtin.SEPARATOR]
    n_train, n_val = len(parts["train"]) // 2, len(parts["val"]) // 2
    if n_train and n_val:
        train = np.frombuffer(b"".join(parts["train"]), dtype=np.uint8)
        val = np.frombuffer(b"".join(parts["val"]), dtype=np.uint8)
        return train, val, n_train, n_val
    everything = np.frombuffer(b"".join(parts["train"] + parts["val"]), dtype=np.uint8)
    cut = len(everything) - max(1, round(len(everything) * val_fraction))
    return everything[:cut], everything[cut:], n_train + n_val, 0


def load_text(cfg: DataConfig) -> TokenData:
    if cfg.path is None:
        raise DataError("data.path is required for data.source: text; name text files, directories or globs")
    files = expand_text_paths(cfg.path)
    total = sum(f.stat().st_size for _, f in files)
    if total == 0:
        raise DataError(
            f"data.path: {cfg.path} matched {len(files)} files with 0 bytes in total; "
            "point it at non-empty text"
        )
    train, val, n_train, n_val = split_text_files(files, cfg.val_fraction)
    how = f"{n_train} train / {n_val} val files" if n_val else f"{n_train} files, split by bytes"
    description = f"text {cfg.path} ({how}, train={_mtok(len(train))} val={_mtok(len(val))} byte tokens)"
    return TokenData(train, val, _byte_vocab(cfg), description)
