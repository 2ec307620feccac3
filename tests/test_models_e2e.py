"""`muloco train` with your own model and data: a factory model, a tiny HF GPT-2 and a tiny HF Llama on a
BPE dataset prepared from (part of) the built-in corpus, workers=2; `muloco sample` from the runs."""

import json
import sysconfig
import textwrap
from pathlib import Path

import pytest
from test_helpers import run_muloco as muloco
from test_helpers import run_muloco_here

from muloco.tools.sample import sample_run

ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# The quickstart config, made tiny; model.* comes from each case.
SMALL = [
    "model.seq_len=32",
    "workers=2",
    "train.batch_tokens=256",
    "train.total_tokens=6144",
    "train.eval_every=12",
    "train.eval_tokens=1024",
    "train.warmup_steps=2",
    "sync.every=4",
    "logging.progress=off",
]
GPT2 = "model.hf={model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2}"
LLAMA = (
    "model.hf={model_type: llama, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}"
)
FACTORY = textwrap.dedent(
    """
    from torch import nn

    class MLPLM(nn.Module):
        def __init__(self, vocab_size, width):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.hidden = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
            self.unembed = nn.Linear(width, vocab_size, bias=False)

        def forward(self, ids):
            return self.unembed(self.hidden(self.embed(ids)))

    def build(vocab_size, width=32):
        return MLPLM(vocab_size, width)
    """
)


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A 384-token BPE over two stdlib packages (the built-in corpus is the stdlib), via the CLI."""
    out = tmp_path_factory.mktemp("data") / "bpe"
    inputs = [f"{STDLIB}/json/*.py", f"{STDLIB}/email/*.py"]
    result = muloco("data", "prepare", *inputs, "--out", out, "--tokenizer", "bpe:384")
    assert result.returncode == 0, result.stderr
    assert "prepared" in result.stderr and json.loads((out / "meta.json").read_text())["vocab_size"] == 384
    return out


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
@pytest.mark.parametrize("model", ["factory", "gpt2", "llama"])
def test_train_and_sample_with_your_own_model_and_bpe_data(tmp_path, bpe_data, model, monkeypatch):
    (tmp_path / "my_lm.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)  # sample_run imports the factory's module from here, as the CLI would
    model_args = {
        "factory": ["model.factory=my_lm:build", "model.kwargs={width: 24}"],
        "gpt2": [GPT2],
        "llama": [LLAMA],
    }[model]
    data = ["data.source=tokens", f"data.path={bpe_data}"]
    out = tmp_path / "runs"
    args = [
        ROOT / "configs/quickstart.yaml",
        *SMALL,
        *data,
        *model_args,
        f"run.output_dir={out}",
        "run.name=r",
    ]
    result = muloco("train", *args, cwd=tmp_path)  # the factory's module is found in the current directory
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] < summary["initial_val_loss"] - 0.3
    assert "inner optimizer routing" in result.stderr and "muloco sample" in result.stderr
    run_dir = out / "r"
    assert (run_dir / "tokenizer.json").read_bytes() == (bpe_data / "tokenizer.json").read_bytes()

    first = sample_run(str(run_dir), prompt="import ", tokens=24, seed=5, samples=2)
    again = sample_run(str(run_dir), prompt="import ", tokens=24, seed=5, samples=2)
    other = sample_run(str(run_dir), prompt="import ", tokens=24, seed=6, samples=2)
    assert first == again and first != other  # seeded
    assert all(text.startswith("import ") and len(text) > len("import ") for text in first)
    if model == "llama":  # the CLI prints the same text
        flags = ["--prompt", "import ", "--tokens", "24", "--seed", "5", "--samples", "2"]
        shown = muloco("sample", run_dir, *flags, cwd=tmp_path)
        assert shown.returncode == 0 and shown.stdout == "".join(t + "\n" for t in first), shown.stderr


def test_sample_from_a_byte_level_run_decodes_bytes(tmp_path, tiny):
    result = muloco("train", ROOT / "configs/quickstart.yaml", *tiny, "run.name=b")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "b"
    assert json.loads((run_dir / "tokenizer_info.json").read_text()) == {
        "vocab_size": 256,
        "tokenizer": "byte",
    }
    greedy = sample_run(str(run_dir), prompt="def ", tokens=16, temperature=0)
    assert greedy == sample_run(
        str(run_dir), prompt="def ", tokens=16, temperature=0, seed=9
    )  # no randomness
    assert greedy[0].startswith("def ")


def test_sample_errors_are_one_line(tmp_path):
    for args, needle in (
        ([tmp_path], "has no config.yaml"),
        ([ROOT / "configs"], "has no config.yaml"),
    ):
        result = run_muloco_here("sample", *args)
        assert result.returncode == 2 and needle in result.stderr and len(result.stderr.splitlines()) == 1
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    result = run_muloco_here("sample", run_dir)
    assert result.returncode == 2 and "no checkpoint yet" in result.stderr, result.stderr
    result = run_muloco_here("sample", run_dir, "--tokens", "0")
    assert result.returncode == 2 and "--tokens" in result.stderr


@pytest.mark.parametrize(
    "command, needle",
    [
        (["train", "QS", "model.factory=no_such_module_xyz:build"], "model.factory: cannot import"),
        (["train", "QS", "model.hf={model_type: llama, hiden_size: 8}"], "model.hf.hiden_size"),
        (["train", "QS", "model.kwargs={width: 8}"], "model.kwargs applies to model.factory"),
        (["data", "prepare", "/nonexistent/*.txt", "--out", "OUT"], "INPUT: '/nonexistent/*.txt' matches no"),
        (["data", "prepare", "QS", "--out", "OUT", "--tokenizer", "bpe:12"], "--tokenizer bpe:12"),
    ],
)
def test_cli_errors_for_models_and_data_are_one_line_exit_2(tmp_path, command, needle):
    args = [
        ROOT / "configs/quickstart.yaml" if a == "QS" else tmp_path / "out" if a == "OUT" else a
        for a in command
    ]
    result = run_muloco_here(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
def test_a_factory_changed_under_a_checkpoint_is_a_clean_error(tmp_path, tiny):
    (tmp_path / "my_lm.py").write_text(FACTORY)
    args = ["train", ROOT / "configs/quickstart.yaml", *tiny, "model.factory=my_lm:build", "run.name=f"]
    assert muloco(*args, cwd=tmp_path).returncode == 0
    (tmp_path / "my_lm.py").write_text(FACTORY.replace("width=32", "width=48"))  # same config, other shapes
    result = muloco(*args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert (
        result.returncode == 2 and "does not fit this run" in lines[-1] and "Traceback" not in result.stderr
    )


@pytest.mark.slow  # processes of their own (CLI runs or ranks): 5-17 s on 2 cores
def test_sample_refuses_token_files_of_unknown_tokenizer(tmp_path, tiny):
    import numpy as np

    data = tmp_path / "bare"
    data.mkdir()
    for split in ("train", "val"):
        np.random.default_rng(0).integers(0, 300, 5000, dtype=np.uint16).tofile(data / f"{split}.bin")
    args = [*tiny, "data.source=tokens", f"data.path={data}", "data.vocab_size=300", "run.name=u"]
    assert muloco("train", ROOT / "configs/quickstart.yaml", *args).returncode == 0
    result = muloco("sample", tmp_path / "runs" / "u")
    assert result.returncode == 2 and "muloco data prepare" in result.stderr, result.stderr
