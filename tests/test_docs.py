"""The documentation's runnable examples run."""

import json
import re
from pathlib import Path

from muloco.config import load_config

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_python_api_diloco_examples_run():
    """Every python block of docs/python-api.md after the signature (the DiLoCo examples) runs."""
    text = (DOCS / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    examples = [b for b in blocks if "import muloco" in b and "Trainer" not in b]
    assert len(examples) == 2
    for example in examples:
        exec(compile(example, "docs/python-api.md", "exec"), {"__name__": "docs_example"})


ROOT = DOCS.parent
QS = "configs/quickstart.yaml"
# The quickstart made tiny; run.name (quickstart) and every other key come from the real file.
TINY_QUICKSTART = f"""extends: {ROOT / QS}
model: {{preset: nano, d_model: 32, n_layers: 2, n_heads: 2, seq_len: 32}}
train: {{batch_tokens: 256, total_tokens: 1024, eval_every: 4, eval_tokens: 256, warmup_steps: 1}}
sync: {{every: 2}}
logging: {{progress: "off"}}
"""


def _train_lines(path: Path) -> list[list[str]]:
    """The `muloco train configs/quickstart.yaml ...` commands of a doc, in order, as argument lists."""
    lines = re.findall(rf"^muloco train {re.escape(QS)}([^#\n]*)", path.read_text(), flags=re.M)
    return [line.split() for line in lines]


def test_the_docs_train_commands_run_one_after_another_and_no_run_is_lost(tmp_path, capsys):
    """The README tour's and docs/quickstart.md's train commands, then docs/data.md's, in the order a
    newcomer meets them (at tiny token counts): each runs (none is refused for a run.name another config
    holds), each config gets a directory of its own, and resume=never moves the earlier run aside."""
    from muloco.cli import main

    config = tmp_path / "quickstart.yaml"
    config.write_text(TINY_QUICKSTART)
    runs = tmp_path / "runs"
    quickstart_doc, readme = _train_lines(DOCS / "quickstart.md"), _train_lines(ROOT / "README.md")
    commands = [quickstart_doc[0], *readme, *quickstart_doc[1:]]
    assert len(commands) >= 6 and ["workers=8"] in commands and ["method=dp"] in commands
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    assert main(["data", "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "tok")]) == 0
    data_doc = _train_lines(DOCS / "data.md")
    commands.append([a.replace("data/corpus-bpe4k", str(tmp_path / "tok")) for a in data_doc[-1]])
    for overrides in commands:
        assert main(["train", str(config), *overrides, f"run.output_dir={runs}"]) == 0, overrides
    capsys.readouterr()

    configs = {}
    for run_dir in sorted(runs.iterdir()):
        if run_dir.name.startswith("."):
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed", run_dir
        configs[run_dir.name] = load_config(str(run_dir / "config.yaml")).fingerprint()
    distinct = {tuple(sorted(c)) for c in commands}
    assert len(configs) == len(distinct) == len(set(configs.values()))  # one directory per config
    assert {"quickstart", "quickstart_w8", "quickstart_dp", "quickstart_adamw"} <= set(configs)
    assert load_config(str(runs / "quickstart/config.yaml")).workers == 4  # the first run, untouched

    before = (runs / "quickstart" / "summary.json").read_text()
    assert main(["train", str(config), f"run.output_dir={runs}", "checkpoint.resume=never"]) == 0
    moved = list((runs / ".replaced").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith("quickstart-")
    assert (moved[0] / "summary.json").read_text() == before  # the earlier run, whole
    assert (moved[0] / "checkpoints").is_dir() and (runs / "quickstart" / "summary.json").is_file()


def test_the_quickstarts_eval_and_export_commands_and_its_transformers_lines_run(
    tmp_path, monkeypatch, capsys
):
    """docs/quickstart.md "Use it elsewhere": its muloco eval and export commands on the (tiny) quickstart
    run, then its Python block, which loads the export in transformers and generates."""
    import pytest

    pytest.importorskip("transformers")
    from muloco.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart.yaml").write_text(TINY_QUICKSTART)
    assert main(["train", "quickstart.yaml"]) == 0
    text = (DOCS / "quickstart.md").read_text().split("## Use it elsewhere")[1].split("\n## ")[0]
    commands = re.findall(r"^muloco (eval|export)([^#\n]*)", text, flags=re.M)
    assert [c[0] for c in commands] == ["eval", "export"]
    for command, args in commands:
        assert main([command, *args.split()]) == 0, (command, args)
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    assert len([line for line in block.splitlines() if line.strip()]) <= 5  # "in 5 lines of Python"
    capsys.readouterr()
    block = block.replace("max_new_tokens=40", "max_new_tokens=20")  # the tiny run's context is 32
    exec(compile(block, "docs/quickstart.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.startswith("def ")
