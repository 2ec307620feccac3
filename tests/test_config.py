"""Config schema: loading, extends, overrides, and one clear error per kind of bad input."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from muloco.config import ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_resolve_the_preset():
    cfg = load_config(None)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads) == (256, 4, 4)
    assert cfg.inner.optimizer == "muon" and cfg.outer.lr == 0.7


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("workers=4", ["workers"], 4),
        ("inner.lr=1e-3", ["inner", "lr"], 1e-3),
        ("logging.wandb=true", ["logging", "wandb"], True),
        ("inner.adamw.betas=[0.9, 0.99]", ["inner", "adamw", "betas"], [0.9, 0.99]),
        ("run.name=my-run", ["run", "name"], "my-run"),
        ("data.path=null", ["data", "path"], None),
    ],
)
def test_override_parsing(text, key, value):
    assert parse_override(text) == (key, value)


def test_text_fields_take_override_values_verbatim():
    cfg = load_config(None, ["run.name=off", "logging.progress=off", "run.output_dir=1e5"])
    assert (cfg.run.name, cfg.logging.progress, cfg.run.output_dir) == ("off", "off", "1e5")


def test_overrides_apply_with_type_coercion():
    cfg = load_config(
        None, ["workers=2", "inner.adamw.betas=[0.8,0.9]", "model.preset=nano", "train.batch_tokens=1024"]
    )
    assert cfg.workers == 2 and cfg.inner.adamw.betas == (0.8, 0.9) and cfg.model.d_model == 128


def test_extends_merges_recursively_and_overrides_win(tmp_path):
    write(tmp_path, "base.yaml", "model: {preset: nano, seq_len: 64}\ntrain: {batch_tokens: 1024}\n")
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nmodel: {seq_len: 128}\n")
    cfg = load_config(child, ["train.total_tokens=4096"])
    assert cfg.model.preset == "nano" and cfg.model.seq_len == 128 and cfg.train.total_tokens == 4096


def test_extends_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


BAD_INPUTS = [
    ("missing file", None, [], "config file not found"),
    ("yaml syntax", "train: {total_tokens: 3\n", [], "YAML syntax error"),
    ("unknown key", "trian: {total_tokens: 3}\n", [], "did you mean 'train'"),
    ("unknown nested key", "inner: {lrr: 0.1}\n", [], "did you mean 'lr'"),
    ("unknown override", "", ["train.totl_tokens=5"], "did you mean 'total_tokens'"),
    ("wrong type", "workers: many\n", [], "workers"),
    ("negative lr", "inner: {lr: -0.1}\n", [], "inner.lr"),
    ("zero lr", "", ["outer.lr=0"], "outer.lr"),
    ("zero workers", "workers: 0\n", [], "workers"),
    (
        "batch not divisible",
        "workers: 3\ntrain: {batch_tokens: 1024}\nmodel: {seq_len: 128}\n",
        [],
        "train.batch_tokens",
    ),
    ("bad micro batch", "", ["train.micro_batch_tokens=100"], "train.micro_batch_tokens"),
    ("tokens without path", "data: {source: tokens}\n", [], "data.path"),
    ("bad heads", "model: {d_model: 100, n_heads: 3}\n", [], "model.d_model"),
    ("not a mapping", "- a\n- b\n", [], "mapping"),
    # trimmed_mean among fewer than 2 x trim + 1 would trim less, down to the plain mean (issue 37)
    (
        "trim too large",
        "workers: 4\n",
        ["sync.aggregate=trimmed_mean", "sync.trim=2"],
        "workers=4 gives at most 4",
    ),
    (
        "trim over small groups",
        "workers: 4\nbackend: {kind: hivemind, hivemind: {target_group_size: 2}}\n",
        ["sync.aggregate=trimmed_mean"],
        "backend.hivemind.target_group_size=2 gives at most 2",
    ),
]


@pytest.mark.parametrize("name, text, overrides, expected", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gives_one_line_naming_the_field(tmp_path, name, text, overrides, expected):
    path = tmp_path / "missing.yaml" if text is None else write(tmp_path, "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert expected in message and "\n" not in message


def test_an_error_names_its_source_the_override_or_the_file(tmp_path):
    path = write(tmp_path, "c.yaml", "workers: 4\ninner: {lr: 0.02}\n")
    with pytest.raises(ConfigError, match=r"^override 'workers=abc': workers: .*valid integer"):
        load_config(path, ["workers=abc"])
    with pytest.raises(ConfigError, match=r"^override 'model=\{d_model: x\}': model.d_model"):
        load_config(path, ["model={d_model: x}"])  # a section override blamed for its field
    bad_file = write(tmp_path, "bad.yaml", "workers: abc\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad_file))}: workers"):
        load_config(bad_file, ["inner.lr=0.01"])  # the override is fine: the file is to blame


def test_overrides_that_change_the_maths_name_the_run_after_them(tmp_path):
    """So a docs command never lands in the directory of a run of another config (issue: first hour)."""
    qs = str(ROOT / "configs/quickstart.yaml")
    assert load_config(qs).run.name == "quickstart"
    assert load_config(qs, ["workers=8"]).run.name == "quickstart_w8"
    assert load_config(qs, ["method=dp"]).run.name == "quickstart_dp"
    assert load_config(qs, ["inner.optimizer=adamw"]).run.name == "quickstart_adamw"
    four_bit = ["compression.scheme=statistical", "compression.bits=4"]
    assert load_config(qs, four_bit).run.name == "quickstart_4bit_statistical"
    assert load_config(qs, four_bit[::-1]).run.name == "quickstart_4bit_statistical"  # any order
    assert load_config(qs, ["inner.lr=0.01"]).run.name != load_config(qs, ["outer.lr=0.01"]).run.name
    # What does not change the maths (logging, where it runs, resume) or restates the file keeps the name.
    same = ["logging.progress=off", "train.threads=1", "backend.kind=local", "workers=4", "run.output_dir=x"]
    assert load_config(qs, same).run.name == "quickstart"
    assert load_config(qs, ["workers=8", "run.name=mine"]).run.name == "mine"  # chosen: kept
    long = [f"model.d_model={64}", "model.n_layers=3", "model.n_heads=4", "train.total_tokens=12345"]
    name = load_config(qs, [*long, "train.batch_tokens=2048"]).run.name
    assert name.startswith("quickstart_") and len(name) == len("quickstart_") + 8  # too long: a hash
    assert load_config(None, ["workers=8"]).run.name == "run"  # no file, nothing to derive from


def test_cli_config_prints_resolved_yaml_and_bad_input_exits_2(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "muloco", "config", str(ROOT / "configs/quickstart.yaml"), "workers=2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "workers: 2" in ok.stdout and "d_model:" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "muloco", "config", str(ROOT / "configs/quickstart.yaml"), "inner.lrr=1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "did you mean 'lr'" in bad.stderr and "Traceback" not in bad.stderr


def test_configuration_docs_are_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_config_docs.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_default_configs_fingerprint_is_pinned():
    """A checkpoint resumes only under its config's fingerprint: a key added with its default must leave it
    as it was (config/schema.py's fingerprint drops such keys), or every older run stops resuming. The value
    of the default config since muloco 0.1.0's checkpoints (d8ec0a0): change it only on purpose."""
    assert load_config(None, []).fingerprint() == "c4db52fb6f6e910d"
