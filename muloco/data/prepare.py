"""`muloco data prepare INPUT... --out DIR --tokenizer byte | bpe:VOCAB | PATH`: token files for
`data.source: tokens`.

Inputs are text files (one document each), JSONL (`--field`, one document per line) and Parquet
(`--column`, one document per row), named as files, directories or globs (hidden files skipped, sorted).
Two streaming passes with a progress bar: train the BPE (bpe:VOCAB only), then tokenize and append to
`train.bin` / `val.bin`. Each document ends with the end-of-text id. A document goes to val when the hash of
its key (relative path, plus `#line` or `#row`) is below --val-fraction, as the builtin corpus splits files;
when every document falls on one side (e.g. one text file), the last val-fraction of the tokens are val.

The output directory is written under a temporary name and renamed into place, so it is complete or
absent; `meta.json` records the vocabulary, dtype, tokenizer, split and counts. The same inputs and
options give the same bytes (tests/data/test_prepare.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from muloco.data import builtin
from muloco.data.sources import META_FILE, expand_text_paths, read_text_file
from muloco.data.tokenizer import ByteTokenizer, load_bpe, parse_tokenizer_spec, train_bpe
from muloco.errors import DataError, UserError

log = logging.getLogger("muloco.data")

FORMAT = "muloco-tokens/1"
ENCODE_BATCH = 256  # documents per encode_batch call: tokenizers parallelizes within a batch
FIELD = "INPUT"  # how errors name the inputs
MIN_TOKENS = 16  # below this a train/val split is meaningless


@dataclass
class Counts:
    documents: int = 0
    train_documents: int = 0
    val_documents: int = 0
    train_tokens: int = 0
    val_tokens: int = 0
    input_bytes: int = 0
    skipped_empty: int = 0
    files: list[str] = field(default_factory=list)


def _fail(file: Path, what: str, fix: str) -> DataError:
    return DataError(f"{FIELD}: {file} {what}; {fix}")


def _read_text(file: Path) -> str:
    data = read_text_file(file, field=FIELD)  # unreadable or not UTF-8: one line naming the file
    if b"\x00" in data[: 1 << 20]:
        raise _fail(file, "looks binary (it holds NUL bytes)", "give text, .jsonl or .parquet files")
    return data.decode("utf-8")


def _jsonl_documents(file: Path, key: str, text_field: str) -> Iterator[tuple[str, str]]:
    try:
        with file.open("r", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise _fail(file, f"line {number} is not JSON ({exc})", "fix the line") from None
                value = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(value, str):
                    raise _fail(
                        file,
                        f"line {number} has no string field {text_field!r}",
                        "name the field with --field",
                    )
                yield f"{key}#{number}", value
    except UnicodeDecodeError as exc:
        raise _fail(file, f"is not UTF-8 (bad byte at offset {exc.start})", "convert it") from None
    except OSError as exc:
        raise _fail(file, f"cannot be read ({exc.strerror})", "fix its permissions or leave it out") from None


def _parquet_documents(file: Path, key: str, column: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f'{FIELD}: reading {file} needs pyarrow: pip install -e ".[hf]"') from None
    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise _fail(file, f"is not a Parquet file pyarrow can read ({exc})", "check the file") from None
    if column not in parquet.schema_arrow.names:
        names = ", ".join(parquet.schema_arrow.names)
        raise _fail(file, f"has no column {column!r} (it has {names})", "name the column with --column")
    row = 0
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is not None and not isinstance(value, str):
                raise _fail(
                    file, f"column {column!r} holds {type(value).__name__}, not text", "pick a text column"
                )
            yield f"{key}#{row}", value or ""


def iter_documents(files: list[tuple[str, Path]], text_field: str, column: str) -> Iterator[tuple[str, str]]:
    """(split key, text) of every document in the inputs, in order."""
    for key, file in files:
        suffix = file.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            yield from _jsonl_documents(file, key, text_field)
        elif suffix == ".parquet":
            yield from _parquet_documents(file, key, column)
        else:
            yield key, _read_text(file)


def _progress(total: int, description: str):
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=not sys.stderr.isatty(),
        transient=True,
    )
    return bar, bar.add_task(description, total=total)


def _texts_with_progress(files, text_field, column, description) -> Iterator[str]:
    bar, task = _progress(sum(f.stat().st_size for _, f in files), description)
    with bar:
        for key, file in files:
            for _, text in iter_documents([(key, file)], text_field, column):
                if text:
                    yield text
            bar.advance(task, file.stat().st_size)


def _write_tokens(
    files, tokenizer, text_field: str, column: str, val_fraction: float, dtype: np.dtype, out: Path
) -> Counts:
    sizes = [file.stat().st_size for _, file in files]
    counts = Counts(files=[key for key, _ in files], input_bytes=sum(sizes))
    eot = [] if tokenizer.eot is None else [tokenizer.eot]
    bar, task = _progress(counts.input_bytes, "tokenizing")
    with bar, open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val:
        batch: list[tuple[str, str]] = []

        def flush() -> None:
            for (key, _), ids in zip(batch, tokenizer.encode_batch([t for _, t in batch]), strict=True):
                to_val = builtin.is_val(key, val_fraction)
                np.asarray(ids + eot, dtype=dtype).tofile(val if to_val else train)
                if to_val:
                    counts.val_documents += 1
                else:
                    counts.train_documents += 1
            batch.clear()

        for (key, file), size in zip(files, sizes, strict=True):
            for doc_key, text in iter_documents([(key, file)], text_field, column):
                if not text:
                    counts.skipped_empty += 1
                    continue
                counts.documents += 1
                batch.append((doc_key, text))
                if len(batch) == ENCODE_BATCH:
                    flush()
            bar.advance(task, size)
        flush()
    counts.train_tokens = (out / "train.bin").stat().st_size // dtype.itemsize
    counts.val_tokens = (out / "val.bin").stat().st_size // dtype.itemsize
    return counts


def _cut_by_tokens(out: Path, dtype: np.dtype, val_fraction: float, counts: Counts) -> None:
    """Every document fell on one side: the last val_fraction of all tokens become val (as data.source:
    text does)."""
    if counts.val_tokens and not counts.train_tokens:
        os.replace(out / "val.bin", out / "train.bin")
        (out / "val.bin").touch()
    tokens = np.fromfile(out / "train.bin", dtype=dtype)
    cut = len(tokens) - max(1, round(len(tokens) * val_fraction))
    tokens[:cut].tofile(out / "train.bin")
    tokens[cut:].tofile(out / "val.bin")
    counts.train_tokens, counts.val_tokens = cut, len(tokens) - cut


def prepare(
    inputs: list[str],
    out: str,
    tokenizer_spec: str = "byte",
    *,
    text_field: str = "text",
    column: str = "text",
    val_fraction: float = 0.05,
    force: bool = False,
) -> dict:
    """Write `out/{train.bin, val.bin, meta.json[, tokenizer.json]}`; returns the meta.json record."""
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    kind, value = parse_tokenizer_spec(tokenizer_spec)
    files = expand_text_paths(list(inputs), field=FIELD)
    destination = Path(out).expanduser()
    if destination.exists() and not destination.is_dir():
        raise UserError(f"--out {destination} is a file; name a directory to create")
    if destination.exists() and any(destination.iterdir()) and not force:
        raise UserError(f"--out {destination} exists and is not empty; choose a new directory or add --force")

    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "file":
        tokenizer = load_bpe(value)
    else:
        texts = _texts_with_progress(files, text_field, column, "training BPE")
        tokenizer = train_bpe(texts, value)
    if tokenizer.eot is None:
        log.warning("data prepare: the tokenizer has no end-of-text token; documents are concatenated as is")
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)

    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp_", dir=destination.parent))
    except OSError as exc:
        raise UserError(f"--out {destination}: cannot write there ({exc.strerror or exc})") from None
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would follow the directory into place
    try:
        counts = _write_tokens(files, tokenizer, text_field, column, val_fraction, dtype, staging)
        if counts.documents == 0:
            raise DataError(f"{FIELD}: {' '.join(inputs)} holds no text (every document is empty)")
        if counts.train_tokens + counts.val_tokens < MIN_TOKENS:
            total = counts.train_tokens + counts.val_tokens
            raise DataError(f"{FIELD}: {' '.join(inputs)} makes {total} tokens; give at least {MIN_TOKENS}")
        split = "document hash"
        if not (counts.train_tokens and counts.val_tokens):
            _cut_by_tokens(staging, dtype, val_fraction, counts)
            split = "tokens (every document fell on one side)"
        if tokenizer.name == "tokenizer.json":
            tokenizer.save(staging / "tokenizer.json")
        meta = {
            "format": FORMAT,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "tokenizer": tokenizer.name,
            "eot_token": tokenizer.eot,
            "split": {"val_fraction": val_fraction, "by": split},
            "inputs": {"files": counts.files, "field": text_field, "column": column},
            "counts": {
                "documents": counts.documents,
                "empty_documents_skipped": counts.skipped_empty,
                "train_documents": counts.train_documents,
                "val_documents": counts.val_documents,
                "train_tokens": counts.train_tokens,
                "val_tokens": counts.val_tokens,
                "input_bytes": counts.input_bytes,
            },
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if destination.exists():
            shutil.rmtree(destination)
        os.replace(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return meta
