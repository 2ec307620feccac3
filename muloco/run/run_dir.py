"""The run directory `<run.output_dir>/<run.name>/` (docs/design.md's contract): created and checked before
a run starts, written atomically, and never touched by a run that is refused (bad input, a mismatched resume).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from muloco.comm import Backend
from muloco.config import Config
from muloco.errors import UserError

log = logging.getLogger("muloco")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.run.output_dir).expanduser() / cfg.run.name


REPLACED = ".replaced"  # <output_dir>/.replaced/<name>-<UTC time>/: runs that resume=never started over


def prepare_run_dir(cfg: Config, backend: Backend | None = None) -> Path:
    """Create `<output_dir>/<name>/` and check that it is writable. Nothing of an earlier run is lost:
    `checkpoint.resume=never` on a directory holding a run moves that run to `<output_dir>/.replaced/`
    first, and config.yaml is written only once the run is known to start or resume
    (`write_resolved_config`). Several ranks (a collective): rank 0 first, the others after it."""
    if backend is None or backend.world_size == 1:
        return _prepare(cfg, lead=True)
    if backend.rank == 0:
        _prepare(cfg, lead=True)
    backend.barrier()
    return _prepare(cfg, lead=False) if backend.rank != 0 else run_dir_of(cfg)


def _prepare(cfg: Config, lead: bool) -> Path:
    run_dir = run_dir_of(cfg)
    try:
        if lead and cfg.checkpoint.resume == "never" and holds_a_run(run_dir):
            moved = move_aside(run_dir)
            log.warning("checkpoint.resume=never: the earlier run in %s was moved to %s", run_dir, moved)
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp_", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"run.output_dir: cannot write the run directory {run_dir} ({exc.strerror or exc}); "
            "choose a writable run.output_dir"
        ) from None
    return run_dir


def holds_a_run(run_dir: Path) -> bool:
    """Anything a run writes: its config, metrics, summary or checkpoints."""
    if any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl", "summary.json")):
        return True
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(checkpoints.iterdir())


def move_aside(run_dir: Path) -> Path:
    """Move a run directory to `<output_dir>/.replaced/<name>-<UTC time>/` (a new name each time; out of
    the way of `muloco report <output_dir>`, which reads `<output_dir>/*/summary.json`)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir.parent / REPLACED / f"{run_dir.name}-{stamp}"
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.parent / REPLACED / f"{run_dir.name}-{stamp}-{suffix}"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(run_dir, target)
    return target


def write_resolved_config(cfg: Config, run_dir: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=run_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(cfg.to_yaml())
    os.replace(tmp, run_dir / "config.yaml")


TOKENIZER_RECORD = "tokenizer_info.json"  # how the run's token ids decode: `muloco sample` reads it
TOKENIZER_FILE = "tokenizer.json"  # a copy of the data's BPE tokenizer, when it has one


def write_tokenizer_record(run_dir: Path, data) -> None:
    """The tokenizer travels with the run: `tokenizer_info.json` (vocab size; `byte`, `tokenizer.json` or
    `unknown` for token files without meta.json) and, for BPE data, a copy of its tokenizer.json, so
    samples decode without the data directory."""
    kind = data.tokenizer
    if data.tokenizer_file is not None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=run_dir)
        os.close(fd)
        shutil.copyfile(data.tokenizer_file, tmp)
        os.replace(tmp, run_dir / TOKENIZER_FILE)
        kind = TOKENIZER_FILE
    write_json_atomic(run_dir / TOKENIZER_RECORD, {"vocab_size": data.vocab_size, "tokenizer": kind})
