"""The built-in offline corpus: this interpreter's Python standard library source, as bytes.

Every `.py` file under `sysconfig.get_paths()["stdlib"]` (paths containing `site-packages` or
`dist-packages` excluded, so the corpus does not depend on what is installed), sorted by relative POSIX
path, becomes raw UTF-8 bytes followed by one 0 byte (`SEPARATOR`, an end-of-file token: Python source
never contains NUL, so the model can tell where a file ends). Tokens are bytes: vocab 256.

A file is held out for validation when `split_hash(relative path) < val_fraction` (sha1, stable across
machines and runs; never Python's `hash()`). Files that cannot be read, are not UTF-8, or contain a NUL
byte are skipped; the skip list is recorded in `meta.json`, so the corpus is deterministic for a given
stdlib tree.

Cache layout (`<cache_dir>/builtin-py3.11-v1-val0.05/`): `train.bin`, `val.bin` (uint8) and `meta.json`.
The build writes into a temporary sibling directory and renames it into place, so several processes may
build at once: the first rename wins and the others use the winner's copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from muloco.errors import DataError

log = logging.getLogger("muloco.data")

FORMAT_VERSION = 1  # bump when the bytes a build produces change (separator, file selection, split)
SEPARATOR = b"\x00"  # appended after every file
VOCAB_SIZE = 256
EXCLUDED_PARTS = ("site-packages", "dist-packages")


def default_cache_dir() -> Path:
    """`$MULOCO_CACHE`, else `~/.cache/muloco`."""
    return Path(os.environ.get("MULOCO_CACHE") or "~/.cache/muloco").expanduser()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_hash(key: str) -> float:
    """A stable number in [0, 1) for a file's relative path: the first 8 bytes of its sha1."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_val(key: str, val_fraction: float) -> bool:
    return split_hash(key) < val_fraction


def list_source_files(root: Path) -> list[str]:
    """Relative POSIX paths of the `.py` files under root, sorted, without site-/dist-packages."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded directories early; the check on the full path below is the real rule.
        dirnames[:] = [d for d in dirnames if not any(part in d for part in EXCLUDED_PARTS)]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if not any(part in rel for part in EXCLUDED_PARTS):
                found.append(rel)
    return sorted(found)


def _read_bytes(path: Path) -> bytes:
    return path.read_bytes()


def _usable_bytes(path: Path) -> tuple[bytes | None, str]:
    """The file's bytes, or (None, why it is skipped)."""
    try:
        data = _read_bytes(path)
    except OSError as exc:
        return None, f"unreadable ({type(exc).__name__})"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if SEPARATOR in data:
        return None, "contains a NUL byte"
    return data, ""


def build_corpus(out_dir: Path, root: Path, val_fraction: float) -> dict:
    """Write train.bin, val.bin and meta.json for the source tree at root into out_dir (not atomic)."""
    files = list_source_files(root)
    counts = {"train": 0, "val": 0}
    nbytes = {"train": 0, "val": 0}
    hashers = {"train": hashlib.sha256(), "val": hashlib.sha256()}
    skipped = []
    with open(out_dir / "train.bin", "wb") as train_f, open(out_dir / "val.bin", "wb") as val_f:
        outs = {"train": train_f, "val": val_f}
        for rel in files:
            data, why = _usable_bytes(root / rel)
            if data is None:
                skipped.append([rel, why])
                continue
            split = "val" if is_val(rel, val_fraction) else "train"
            for chunk in (data, SEPARATOR):
                outs[split].write(chunk)
                hashers[split].update(chunk)
            counts[split] += 1
            nbytes[split] += len(data) + len(SEPARATOR)
    fingerprint = hashlib.sha256((hashers["train"].hexdigest() + hashers["val"].hexdigest()).encode())
    meta = {
        "format": "muloco-builtin",
        "format_version": FORMAT_VERSION,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib": str(root),
        "val_fraction": val_fraction,
        "separator": SEPARATOR[0],
        "vocab_size": VOCAB_SIZE,
        "train_files": counts["train"],
        "val_files": counts["val"],
        "skipped_files": len(skipped),
        "skipped": skipped,
        "train_bytes": nbytes["train"],
        "val_bytes": nbytes["val"],
        "fingerprint": fingerprint.hexdigest()[:32],
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def cache_key(val_fraction: float, root: Path | None = None) -> str:
    """`builtin-py3.11-v1-val0.05`; a non-default source tree adds a hash of its path."""
    major, minor = sys.version_info[:2]
    key = f"builtin-py{major}.{minor}-v{FORMAT_VERSION}-val{val_fraction:g}"
    if root is not None and Path(root) != stdlib_root():
        key += "-" + hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:8]
    return key


def read_meta(corpus_dir: Path) -> dict | None:
    """meta.json if the directory holds a complete corpus (file sizes match), else None."""
    try:
        meta = json.loads((corpus_dir / "meta.json").read_text(encoding="utf-8"))
        complete = (
            meta.get("format_version") == FORMAT_VERSION
            and (corpus_dir / "train.bin").stat().st_size == meta["train_bytes"]
            and (corpus_dir / "val.bin").stat().st_size == meta["val_bytes"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if complete else None


def _move_aside(path: Path) -> None:
    """Remove an incomplete corpus directory by renaming it away first, so no reader sees it half-deleted."""
    aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".stale-{path.name}-"))
    try:
        os.rename(path, aside / "old")
    except FileNotFoundError:
        pass  # another process moved it already
    shutil.rmtree(aside, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> bool:
    """Rename tmp to final. False (and tmp removed) if another process published a complete corpus first."""
    for _ in range(3):
        try:
            os.rename(tmp, final)  # atomic; fails when final exists and is not empty
            return True
        except OSError:
            if read_meta(final) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            _move_aside(final)  # left by an interrupted older build or damaged by hand
    raise DataError(f"data.cache_dir: cannot replace the damaged corpus {final}; delete it and run again")


def ensure_builtin_corpus(
    cache_dir: str | Path | None = None, val_fraction: float = 0.05, root: str | Path | None = None
) -> Path:
    """The directory of the cached corpus, built first if missing. Safe to call from many processes."""
    root = Path(root) if root is not None else stdlib_root()
    parent = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = parent / cache_key(val_fraction, root)
    if read_meta(final) is not None:
        log.debug("using builtin corpus path=%s", final)
        return final
    if not root.is_dir():
        raise DataError(
            f"data.source=builtin: the Python stdlib directory {root} is missing; use data.source: text"
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{final.name}-"))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared between users
    except OSError as exc:
        raise DataError(
            f"data.cache_dir: cannot write the builtin corpus cache in {parent} ({exc.strerror}); "
            "set data.cache_dir or $MULOCO_CACHE to a writable directory"
        ) from None
    start = time.perf_counter()
    try:
        meta = build_corpus(tmp, root, val_fraction)
        built = _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if built:
        log.info(
            "built builtin corpus files=%d train_bytes=%d val_bytes=%d skipped=%d path=%s seconds=%.2f",
            meta["train_files"] + meta["val_files"],
            meta["train_bytes"],
            meta["val_bytes"],
            meta["skipped_files"],
            final,
            time.perf_counter() - start,
        )
    return final


def open_builtin_corpus(
    cache_dir: str | Path | None = None, val_fraction: float = 0.05, root: str | Path | None = None
) -> tuple[np.memmap, np.memmap, dict]:
    """(train, val, meta): read-only uint8 memmaps of the cached corpus, built first if needed."""
    corpus_dir = ensure_builtin_corpus(cache_dir, val_fraction, root)
    meta = read_meta(corpus_dir)
    assert meta is not None, f"{corpus_dir=} is incomplete right after ensure_builtin_corpus"
    if meta["train_bytes"] == 0 or meta["val_bytes"] == 0:
        raise DataError(
            f"data.source=builtin: the corpus in {corpus_dir} has an empty split "
            f"(train_bytes={meta['train_bytes']} val_bytes={meta['val_bytes']}); adjust data.val_fraction"
        )
    if meta["python_version"] != platform.python_version():
        log.info(
            "builtin corpus built by python=%s used by python=%s path=%s",
            meta["python_version"],
            platform.python_version(),
            corpus_dir,
        )
    train = np.memmap(corpus_dir / "train.bin", dtype=np.uint8, mode="r")
    val = np.memmap(corpus_dir / "val.bin", dtype=np.uint8, mode="r")
    return train, val, meta
