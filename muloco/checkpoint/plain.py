"""Checkpoints: complete (everything needed to continue bitwise), atomic, loaded with weights_only=True.

Files are `<run_dir>/checkpoints/step_<inner step, 8 digits>.pt`. A write goes to a temporary file in the
same directory, is fsynced, then renamed over the final name, so a crash leaves either the old set of
checkpoints or the new one, never a torn file under a final name.

Integrity: torch.save writes a zip archive holding a CRC-32 of every record (the pickled structure and each
tensor's bytes), but torch.load does not check them, so bytes damaged on disk would load as wrong weights.
`load_checkpoint` verifies every record's CRC first (`verify_archive`); a damaged file is treated like a torn
one: skipped with a warning naming it, and the next older valid checkpoint used.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from muloco.errors import CheckpointError

log = logging.getLogger("muloco")
# 2: the run's components, each under its own name (engine, progress, ledger, wan, replicas, ...).
FORMAT_VERSION = 2
_NAME = re.compile(r"^step_(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    """The inner step in a checkpoint's file name (`step_00000012.pt` -> 12)."""
    return int(_NAME.match(path.name).group(1))


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name))


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Write atomically (temp file, fsync, rename, fsync dir); keep the newest `keep` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp_", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f, _records_checksummed():
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


class _records_checksummed:
    """torch.save computes the records' CRC-32s unless a user turned that off
    (`torch.serialization.set_crc32_options`): a checkpoint always carries them."""

    def __enter__(self) -> None:
        self.previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(True)

    def __exit__(self, *exc) -> None:
        torch.serialization.set_crc32_options(self.previous)


def verify_archive(path: Path) -> None:
    """Every record of the checkpoint's zip archive matches the CRC-32 written with it; else
    CheckpointError. Bytes outside the records (zip headers' padding) do not change what loads."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except Exception as exc:  # damaged headers raise many types (BadZipFile, struct.error, ...)
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a muloco checkpoint ({type(exc).__name__}); "
            "delete it or set checkpoint.resume=never"
        ) from None
    if damaged is not None:
        raise CheckpointError(
            f"checkpoint {path} is damaged: record {damaged} does not match its checksum; "
            "delete it or set checkpoint.resume=never"
        )


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint; a missing, truncated, damaged or foreign file raises CheckpointError."""
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint.resume: file not found: {path}; check the path or use resume=never"
        )
    verify_archive(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a torn or foreign file
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a muloco checkpoint ({type(exc).__name__}); "
            "delete it or set checkpoint.resume=never"
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(
            f"checkpoint {path} is not a muloco checkpoint; delete it or set checkpoint.resume=never"
        )
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {state['format']}, this muloco reads version "
            f"{FORMAT_VERSION}; finish that run with the muloco that wrote it, or set checkpoint.resume=never"
        )
    return state


def find_resume_state(resume: str, directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """What `checkpoint.resume` asks for: None (start fresh) or (path, state).

    `auto` takes the newest valid checkpoint and falls back to older ones, with a warning, when the newest
    is corrupt; if every checkpoint is corrupt it raises rather than silently starting over.
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        return path, load_checkpoint(path)
    candidates = list_checkpoints(directory)
    errors = []
    for path in reversed(candidates):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping unreadable checkpoint path=%s reason=%s", path, exc)
            errors.append(str(exc))
    if errors:
        raise CheckpointError(errors[0])
    return None
