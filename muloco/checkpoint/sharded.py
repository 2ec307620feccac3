"""Sharded checkpoints (`sharding: fsdp`): torch.distributed.checkpoint (DCP), one directory per step.

Every rank writes its rows of the model, the inner optimizer state and the engine's per-shard state (the
global copy, the outer momentum, error-feedback buffers, a mean in flight) as DTensors, so a run resumes
with another number of ranks per worker: DCP reads each rank's new rows from whichever files hold them.
The rest of the run's state (counters, streams, RNG) is the same on a worker's ranks and written once.

Layout: `<run_dir>/checkpoints/sharded/step_<inner step, 8 digits>/` (DCP's files and `.metadata`, under
one key prefix per replica, `replica<r>/...`). Atomic as plain.py: every rank writes into a hidden
temporary directory, and rank 0 renames it to its final name only after all ranks finished, so a rank
killed mid-write (even kill -9) leaves the previous steps as they were; resume takes the newest complete
step, which every rank shares. The directory must be visible to every rank (one machine, or a shared file
system across nodes).

Integrity: before the rename, rank 0 writes DIGESTS (the SHA-256 of every file DCP wrote); a checkpoint whose
files do not match them (bytes damaged on disk: DCP has no checksum of its own) is skipped like a torn one,
with a warning naming the file, and the next older complete one used.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from muloco.checkpoint.plain import fsync_directory
from muloco.errors import CheckpointError
from muloco.sharding import is_dtensor

log = logging.getLogger("muloco")

FORMAT_VERSION = 1
INFO = "muloco.json"  # format, step, the config's layout-free fingerprint, workers
DIGESTS = "digests.json"  # {file name: SHA-256} of every other file of the checkpoint
_NAME = re.compile(r"^step_(\d{8})$")


class Ranks(Protocol):
    """What a sharded checkpoint asks of the processes that write or read it: a backend of muloco.comm is
    one (checkpoint/ sits below comm/, docs/design.md, so it names the methods, not the class)."""

    rank: int  # this process's index; rank 0 renames, prunes and reads the shared directory

    def barrier(self) -> None: ...

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None) -> Any:
        """A handle whose wait() returns every process's payload, in rank order."""
        ...


def list_sharded(directory: Path) -> list[Path]:
    """Complete sharded checkpoints (renamed into place, with DCP's metadata), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _NAME.match(p.name) and (p / ".metadata").is_file())


def _flatten(value: Any, key: str, flat: dict[str, Any]) -> Any:
    """The skeleton of `value`: nested dicts and lists as they are, each tensor replaced by a record of
    its key in `flat` (where the tensor goes), its global shape and dtype, and whether it is sharded."""
    if isinstance(value, dict):
        return {k: _flatten(v, f"{key}/{k}", flat) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_flatten(v, f"{key}/{i}", flat) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, torch.Tensor):
        flat[key] = value
        sharded = is_dtensor(value)
        return {"__tensor__": key, "shape": list(value.shape), "dtype": str(value.dtype), "sharded": sharded}
    return value


def _is_record(value: Any) -> bool:
    return isinstance(value, dict) and "__tensor__" in value


def _targets(skeleton: Any, mesh, flat: dict[str, Any]) -> None:
    """Empty tensors to load into, laid out for this run: a sharded one as this rank's rows on `mesh`
    (whole without a mesh: one process reading the checkpoint, e.g. `muloco sample`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import zeros as dtensor_zeros

    def rows(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        return dtensor_zeros(shape, dtype=dtype, device_mesh=mesh, placements=[Shard(0)])

    _fill_targets(skeleton, rows if mesh is not None else None, flat)


def _fill_targets(skeleton: Any, rows, flat: dict[str, Any]) -> None:
    if _is_record(skeleton):
        dtype = getattr(torch, skeleton["dtype"].removeprefix("torch."))
        shape = skeleton["shape"]
        if skeleton["sharded"] and rows is not None:
            flat[skeleton["__tensor__"]] = rows(shape, dtype)
        else:
            flat[skeleton["__tensor__"]] = torch.zeros(shape, dtype=dtype, device="cpu")
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _fill_targets(v, rows, flat)
    elif isinstance(skeleton, list | tuple):
        for v in skeleton:
            _fill_targets(v, rows, flat)


def _rebuild(skeleton: Any, flat: dict[str, Any]) -> Any:
    if _is_record(skeleton):
        return flat[skeleton["__tensor__"]]
    if isinstance(skeleton, dict):
        return {k: _rebuild(v, flat) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        items = [_rebuild(v, flat) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def save_sharded(
    state: dict[str, Any],
    directory: Path,
    step: int,
    keep: int,
    backend: Ranks,
    prefix: str,
    lead: bool,
    info: dict[str, Any],
) -> Path:
    """Every rank's part of the run's state under `prefix` (a collective: every rank of the run calls it
    at the same step; `lead`: this rank is its worker's first). `info`: what a resume checks before it
    reads anything (rank 0 writes it to INFO). Returns the checkpoint's directory; keeps the newest
    `keep`."""
    import torch.distributed.checkpoint as dcp

    final = directory / f"step_{step:08d}"
    tmp = directory / f".tmp_step_{step:08d}"
    if backend.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".tmp_step_*"):  # writes a killed run left behind
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        (tmp / INFO).write_text(json.dumps({"format": FORMAT_VERSION, "step": step, **info}))
    backend.barrier()
    flat: dict[str, Any] = {}
    skeleton = _flatten({"format": FORMAT_VERSION, **state}, prefix, flat)
    if lead:
        # The worker's lead writes the skeleton (the non-tensor state, the same on the worker's ranks) as
        # bytes in a tensor: DCP writes plain objects from the run's rank 0 only.
        buffer = io.BytesIO()
        torch.save(skeleton, buffer)
        flat[f"{prefix}/skeleton"] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    backend.barrier()  # every rank's files are there
    if backend.rank == 0:
        _write_digests(tmp)
        aside = directory / f".old_step_{step:08d}"
        if final.exists():  # the same step again (a finished run resumed): replaced, never missing
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_directory(directory)
        shutil.rmtree(aside, ignore_errors=True)
        for old in list_sharded(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    backend.barrier()
    return final


def with_ranks_rng(state: dict[str, Any], worker: Ranks) -> dict[str, Any]:
    """The state a worker of R ranks saves with save_sharded: the lead writes the state that is the same on
    its ranks, so the ranks' RNG states go along as a list (`state["rng"]` becomes {"by_rank": [...]}). A
    collective of the worker's ranks."""
    buffer = io.BytesIO()
    torch.save(state["rng"], buffer)
    blobs = worker.all_gather_bytes(buffer.getvalue()).wait()
    return {**state, "rng": {"by_rank": [torch.load(io.BytesIO(b), weights_only=True) for b in blobs]}}


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_digests(directory: Path) -> None:
    files = [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(DIGESTS)]
    digests = {p.name: _file_digest(p) for p in files}
    tmp = directory / f".tmp_{DIGESTS}"
    with tmp.open("w") as f:
        json.dump(digests, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / DIGESTS)


def verify_digests(path: Path) -> None:
    """Every file of the checkpoint is there and matches DIGESTS; else CheckpointError. A checkpoint
    without DIGESTS was written before they existed (a save writes them before the checkpoint's rename):
    read as it is, with a warning."""
    if not (path / DIGESTS).exists():
        log.warning("sharded checkpoint %s has no %s (an older muloco wrote it): not checked", path, DIGESTS)
        return
    digests = _read_json(path, DIGESTS)
    for name, expected in sorted(digests.items()):
        file = path / name
        if not file.is_file() or _file_digest(file) != expected:
            raise CheckpointError(
                f"sharded checkpoint {path} is damaged: {name} does not match its digest; "
                "delete it or set checkpoint.resume=never"
            )


def _read_json(path: Path, name: str) -> dict[str, Any]:
    """One of the checkpoint's JSON files (INFO, DIGESTS); unreadable is a CheckpointError."""
    try:
        return json.loads((path / name).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"sharded checkpoint {path} has no readable {name} ({type(exc).__name__}); set "
            "checkpoint.resume=never or name another step"
        ) from None


def read_info(path: Path) -> dict[str, Any]:
    """The checkpoint's INFO (no collective: every rank reads the same file)."""
    info = _read_json(path, INFO)
    if info.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"sharded checkpoint {path} has format {info.get('format')}, this muloco reads "
            f"{FORMAT_VERSION}; set checkpoint.resume=never"
        )
    return info


def find_sharded(resume: str, directory: Path, backend: Ranks) -> Path | None:
    """The checkpoint `checkpoint.resume` names: the newest complete one (auto), a given directory, or
    none (never). Every rank reads the same directory; rank 0's answer is everyone's."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint.resume: {path} is not a sharded checkpoint (a step_* directory with "
                "DCP's .metadata); check the path or set checkpoint.resume=never"
            )
        verify_digests(path)
        return path
    newest, problem = "", ""
    if backend.rank == 0:  # the files are shared: one rank reads them
        newest, problem = newest_intact(list_sharded(directory))
    answer = backend.all_gather_bytes(json.dumps([newest, problem]).encode()).wait()[0]
    newest, problem = json.loads(answer)
    if problem:
        raise CheckpointError(problem)
    return directory / newest if newest else None


def newest_intact(found: list[Path]) -> tuple[str, str]:
    """(the newest checkpoint whose files match their digests, "") or ("", the first problem) when every
    one is damaged; ("", "") when there are none."""
    problems = []
    for path in reversed(found):
        try:
            verify_digests(path)
            return path.name, ""
        except CheckpointError as exc:
            log.warning("skipping damaged checkpoint path=%s reason=%s", path, exc)
            problems.append(str(exc))
    return "", problems[0] if problems else ""


def _read(path: Path, prefix: str, mesh) -> tuple[Any, dict[str, Any]]:
    """The replica's skeleton (its own small tensor), then every tensor it names."""
    import torch.distributed.checkpoint as dcp

    key = f"{prefix}/skeleton"
    size = dcp.FileSystemReader(path).read_metadata().state_dict_metadata[key].size
    head = {key: torch.zeros(size, dtype=torch.uint8)}
    alone = mesh is None  # one process reads the whole checkpoint
    dcp.load(head, checkpoint_id=path, no_dist=alone)
    skeleton = torch.load(io.BytesIO(head[key].numpy().tobytes()), weights_only=True)
    flat: dict[str, Any] = {}
    _targets(skeleton, mesh, flat)
    dcp.load(flat, checkpoint_id=path, no_dist=alone)
    return skeleton, flat


def load_sharded(path: Path, prefix: str, mesh) -> dict[str, Any]:
    """This replica's state from the checkpoint at `path`, laid out for this run: sharded tensors as
    DTensors of this rank's rows on `mesh` (any number of ranks; a collective), the rest whole. Without a
    mesh (and without torch.distributed): every tensor whole."""
    try:
        with warnings.catch_warnings():
            # Reading alone is meant here; DCP warns that torch.distributed is not initialized.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            skeleton, flat = _read(path, prefix, mesh)
    except Exception as exc:  # DCP raises many types for a missing key or a torn file
        raise CheckpointError(
            f"sharded checkpoint {path} is unreadable or holds no {prefix} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); set checkpoint.resume=never"
        ) from None
    state = _rebuild(skeleton, flat)
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"sharded checkpoint {path} has format {state.get('format')}, this muloco reads "
            f"{FORMAT_VERSION}; set checkpoint.resume=never"
        )
    return state
