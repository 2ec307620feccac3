"""The run directory `<run.output_dir>/<run.name>/` (DESIGN.md contract): created and checked before a run
starts, written atomically, and never touched by a run that is refused (bad input, a mismatched resume).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from muloco.config import Config
from muloco.errors import UserError


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def prepare_run_dir(cfg: Config) -> Path:
    """Create `<output_dir>/<name>/` and check that it is writable; nothing of an earlier run is touched
    (config.yaml is written only once the run is known to start or resume: `write_resolved_config`)."""
    run_dir = Path(cfg.run.output_dir).expanduser() / cfg.run.name
    try:
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
