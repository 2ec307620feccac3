"""Pointers that stay true: every file of this repository that a docstring or comment under muloco/ names
(`docs/design.md`, `muloco/sync/engine.py`, `sync/counters.py`, a sibling module's `engine.py`) exists.

A name with a folder resolves from the repository's root, from the naming file's folder or from muloco/,
or as the tail of a tracked path (`sync/counters.py`); a bare file name from the naming file's folder or
anywhere in the repository. Run outputs and data files (`runs/<name>/summary.json`, a Hugging Face
directory's `config.json`) and other projects' files are not paths of this repository: `NOT_OURS` lists
them, each with why."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A file name with one of these endings, after a space, a quote, a bracket or a backtick.
PATH = re.compile(r"(?<![\w./<>{$-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|yaml|yml|toml|sh|txt|json))\b")

NOT_OURS = {
    # What a run, a sweep or a data preparation writes (docs/design.md's run directory), not repo files.
    "summary.json": "a run's summary",
    "config.yaml": "a run's resolved config",
    "report.md": "a sweep's report",
    "tuned.json": "a sweep's tuned comparison",
    "sweep.json": "a sweep's record",
    "meta.json": "a token directory's metadata (muloco data prepare)",
    "tokenizer.json": "a BPE tokenizer file (muloco data prepare, a run directory)",
    "tokenizer_info.json": "a run directory's tokenizer record",
    "config.json": "a Hugging Face model directory's config",
    "tokenizer_config.json": "a Hugging Face model directory's tokenizer config",
    "generation_config.json": "a Hugging Face model directory's generation config",
    "SWEEP.yaml": "a user's sweep file (the CLI's usage line)",
    # Other projects' files, cited as sources.
    "train_gpt.py": "modded-nanogpt's training script (Muon's origin)",
    "local_sgd.py": "torchft's DiLoCo",
    "quantization.py": "hivemind's compression/quantization.py",
    "encoder.py": "OpenAI's GPT-2 encoder.py (the byte-level BPE)",
    "powerSGD_hook.py": "torch's DDP PowerSGD hook",
    "sparseloco.py": "SparseLoCo's reference code (tplr/sparseloco.py, its authors' initial commit)",
}


def _texts(path: Path):
    """(line, text) of every comment and docstring in a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    yield first.lineno, first.value.value


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def _exists(name: str, named_in: Path, tracked: list[str]) -> bool:
    if "/" not in name:
        return (named_in.parent / name).exists() or any(Path(t).name == name for t in tracked)
    for base in (ROOT, named_in.parent, ROOT / "muloco"):
        if (base / name).exists():
            return True
    return any(t.endswith("/" + name) for t in tracked)


def stale_pointers() -> list[str]:
    tracked = _tracked()
    stale = []
    for path in sorted((ROOT / "muloco").rglob("*.py")):
        for line, text in _texts(path):
            for match in PATH.finditer(text):
                name = match.group(1)
                if name.startswith("../"):  # relative to a user's file, as an example shows
                    continue
                if Path(name).name in NOT_OURS or _exists(name, path, tracked):
                    continue
                stale.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return stale


def test_every_file_a_docstring_or_comment_names_exists():
    stale = stale_pointers()
    assert not stale, "files named but not in the repository:\n" + "\n".join(stale)


def test_the_check_catches_a_stale_pointer(tmp_path):
    """The rule itself: a name that exists passes, a made-up one does not."""
    tracked = _tracked()
    here = ROOT / "muloco" / "sync" / "engine.py"
    assert _exists("docs/design.md", here, tracked) and _exists("sync/counters.py", here, tracked)
    assert _exists("fragments.py", here, tracked) and _exists("muloco/sync/engine.py", here, tracked)
    assert not _exists("run_state.py", here, tracked) and not _exists("DESIGN.md", here, tracked)
    assert not _exists("docs/nowhere.md", here, tracked)
