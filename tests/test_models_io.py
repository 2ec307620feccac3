"""Models in and out (issue 39, docs/models.md): start from a pretrained Hugging Face directory or another
run, export a run to a Hugging Face directory that transformers loads with the same logits, evaluate runs
and exported directories. Offline: every model and tokenizer here is made by the test itself."""

import json
import math
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from test_helpers import run_muloco_here

from muloco.checkpoint.plain import list_checkpoints
from muloco.config import load_config
from muloco.data.tokenizer import byte_tokenizer_for_hf
from muloco.errors import CheckpointError
from muloco.models import build_model
from muloco.models.gpt import GPT, GPTConfig
from muloco.models.gpt2 import gpt2_config_values, gpt2_state_dict
from muloco.models.init import initialize
from muloco.run.trainer import Trainer
from muloco.tools.eval_model import evaluate_path
from muloco.tools.trained import load_trained_run

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXT = "def f(x):\n\treturn x + 1  # héllo wörld, 世界 🚀 \x00 Ā"
GPT2 = "model.hf={model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2}"
LLAMA = (
    "model.hf={model_type: llama, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, "
    "num_key_value_heads: 1, intermediate_size: 64}"
)


def train(overrides: list[str]) -> tuple[Trainer, dict]:
    trainer = Trainer(load_config(None, overrides))
    return trainer, trainer.run()


def one_line_error(result, needle: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A 384-token BPE over one stdlib package (the built-in corpus is the stdlib)."""
    out = tmp_path_factory.mktemp("data") / "bpe"
    result = run_muloco_here("data", "prepare", f"{STDLIB}/json/*.py", "--out", out, "--tokenizer", "bpe:384")
    assert result.returncode == 0, result.stderr
    return out


def test_the_byte_tokenizer_loads_in_transformers_and_round_trips_bytes(tmp_path):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer_for_hf())
    fast.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, "  two  spaces\r\n", ""):
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8"))  # the ids are the bytes, as the byte-level runs' data
        assert loaded.decode(ids) == text


@pytest.mark.parametrize("qkv", ["fused", "split"])
def test_the_gpt2_counterpart_computes_the_built_in_gpts_logits(qkv):
    cfg = GPTConfig(vocab_size=300, seq_len=16, d_model=32, n_layers=2, n_heads=4, norm="layernorm", qkv=qkv)
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():  # norms' weights away from 1 too: a swapped norm would show
            p.normal_(0, 0.3)
    model_cfg = load_config(
        None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=16"]
    )
    values = gpt2_config_values(model_cfg.model, 300, None)
    values.pop("model_type")
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**values)).eval()
    theirs.load_state_dict(gpt2_state_dict(dict(ours.named_parameters()), 2), strict=True)
    ids = torch.randint(0, 300, (3, 16))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "model, data",
    [([], "byte"), ([GPT2], "bpe"), ([LLAMA], "byte")],
    ids=["builtin-gpt", "hf-gpt2", "hf-llama"],
)
def test_an_exported_run_loads_in_transformers_with_equal_logits_and_generates(
    tiny, tmp_path, bpe_data, model, data
):
    source = ["data.source=tokens", f"data.path={bpe_data}"] if data == "bpe" else []
    trainer, summary = train([*tiny, *model, *source, "run.name=x"])
    assert summary["status"] == "completed"
    out = tmp_path / "exported"
    result = run_muloco_here("export", trainer.run_dir, out)
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    run = load_trained_run(trainer.run_dir)
    vocab = int(run.tokenizer_info["vocab_size"])
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf(ids).logits[..., :vocab] - run.model(ids)[..., :vocab]).abs().max() <= 1e-4
    # The exported tokenizer encodes as the run's own did, and generate() continues a prompt.
    ours = run.tokenizer()
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ours.encode_batch([TEXT])[0]
    prompt = tokenizer("def ", return_tensors="pt", add_special_tokens=False)
    generated = hf.generate(**prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 6
    assert tokenizer.decode(generated[0]).startswith("def")
    provenance = json.loads((out / "muloco_export.json").read_text())
    assert provenance["step"] == summary["inner_steps"]


def test_export_writes_bf16_and_replaces_only_with_force(tiny, tmp_path):
    trainer, _ = train([*tiny, "run.name=x"])  # the defaults export
    out = tmp_path / "out"
    assert run_muloco_here("export", trainer.run_dir, out, "--dtype", "bf16").returncode == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype="auto")
    assert hf.dtype == torch.bfloat16
    one_line_error(run_muloco_here("export", trainer.run_dir, out), "pass --force")
    first_step = list_checkpoints(trainer.run_dir / "checkpoints")[0].name[5:13]
    result = run_muloco_here("export", trainer.run_dir, out, "--force", "--step", int(first_step))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "muloco_export.json").read_text())["step"] == int(first_step)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []  # no staging left


def test_eval_matches_the_final_val_loss_and_an_exported_copy_on_the_same_tokens(tiny, tmp_path):
    trainer, summary = train([*tiny, "run.name=x"])  # the defaults export
    result = run_muloco_here("eval", trainer.run_dir)
    assert result.returncode == 0, result.stderr
    own = json.loads(result.stdout)
    assert abs(own["loss"] - summary["final_val_loss"]) <= 1e-4
    assert own["perplexity"] == pytest.approx(math.exp(own["loss"]))
    assert json.loads(Path(own["written"]).read_text())["loss"] == own["loss"]
    # Token files prepared with the exported directory's tokenizer (bytes): the run and its export score
    # alike on them; bits per byte = nats per byte / ln 2 (each id but end-of-text is one byte).
    out = tmp_path / "exported"
    assert run_muloco_here("export", trainer.run_dir, out).returncode == 0
    data = tmp_path / "data"
    prepared = run_muloco_here("data", "prepare", f"{STDLIB}/json/*.py", "--out", data, "--tokenizer", out)
    assert prepared.returncode == 0, prepared.stderr
    scores = []
    for path in (trainer.run_dir, out):
        result = run_muloco_here("eval", path, "--data", data, "--tokens", 1024)
        assert result.returncode == 0, result.stderr
        scores.append(json.loads(result.stdout))
    assert abs(scores[0]["loss"] - scores[1]["loss"]) <= 1e-4 and scores[0]["tokens"] == 1024
    nats = scores[0]["loss"] * scores[0]["tokens"]
    assert scores[0]["bits_per_byte"] == pytest.approx(nats / math.log(2) / scores[0]["bytes"])
    assert 0 < scores[0]["bytes"] <= scores[0]["tokens"]


def test_init_from_another_run_starts_from_its_global_parameters(tiny, tmp_path):
    first, summary = train([*tiny, "checkpoint.every=1", "checkpoint.keep=10", "run.name=first"])
    second, second_summary = train([*tiny, f"model.init_from={first.run_dir}", "run.name=second"])
    # The second run's step-0 eval is the first run's final model on the same val set.
    assert second_summary["initial_val_loss"] == summary["final_val_loss"]
    assert second.init_source is not None and second.init_source.field == "model.init_from"
    # One checkpoint file of it: an earlier model (the run's first checkpoint), by its path.
    earliest = list_checkpoints(first.run_dir / "checkpoints")[0]
    _, third = train([*tiny, f"model.init_from={earliest}", "run.name=third"])
    step = int(earliest.name[5:13])
    assert step < summary["inner_steps"]
    assert third["initial_val_loss"] == evaluate_path(first.run_dir, step=step)["loss"]


def save_tiny_llama(directory: Path, vocab_size: int = 256, seed: int = 0) -> None:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def test_continuing_from_pretrained_weights_trains_and_resumes_bitwise(tiny, tmp_path):
    pretrained = tmp_path / "pretrained"
    save_tiny_llama(pretrained)
    overrides = [*tiny, f"model.hf={{pretrained: {pretrained}}}", "checkpoint.every=1", "checkpoint.keep=10"]
    cfg = load_config(None, overrides)
    model = build_model(cfg.model, 256)
    source = initialize(model, cfg.model)
    saved = transformers.AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    for (name, a), b in zip(model.net.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert source.field == "model.hf.pretrained"

    full, summary = train(overrides)
    assert summary["status"] == "completed" and summary["final_val_loss"] < summary["initial_val_loss"]
    expected = [p.detach().clone() for p in full.replicas[0].model.parameters()]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, _ = train([*overrides, f"run.output_dir={resumed_dir}"])
    assert resumed.resumed_from is not None
    for a, b in zip(expected, resumed.replicas[0].model.parameters(), strict=True):
        assert torch.equal(a, b)
    # Other weights under the same path: the resumed run refuses them in one line.
    save_tiny_llama(pretrained, seed=1)
    with pytest.raises(CheckpointError, match="model.hf.pretrained: the weights at .* changed since"):
        train([*overrides, f"run.output_dir={resumed_dir}"])


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "pretrained is not a directory"),
        ("not_a_model", "has no config.json"),
        ("small_vocab", "the model's vocabulary has 100 tokens but the data's has 256"),
        ("both_sources", "model.init_from and model.hf.pretrained both name"),
    ],
)
def test_a_bad_pretrained_directory_is_one_line(tmp_path, TINY, case, needle):
    directory = tmp_path / "pretrained"
    if case == "not_a_model":
        directory.mkdir()
        (directory / "weights.txt").write_text("no model here")
    elif case == "small_vocab":
        save_tiny_llama(directory, vocab_size=100)
    extra = [f"model.init_from={tmp_path}"] if case == "both_sources" else []
    args = [*TINY, f"run.output_dir={tmp_path / 'runs'}", f"model.hf={{pretrained: {directory}}}", *extra]
    one_line_error(run_muloco_here("train", ROOT / "configs/quickstart.yaml", *args), needle)
    assert not (tmp_path / "runs" / "quickstart" / "checkpoints").exists()


def test_export_and_eval_errors_are_one_line_and_write_nothing(tiny, tmp_path, bpe_data):
    rms, _ = train([*tiny, "model.norm=rmsnorm", "run.name=rms"])
    out = tmp_path / "out"
    one_line_error(run_muloco_here("export", rms.run_dir, out), "model.norm=rmsnorm")
    assert not out.exists() and [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    one_line_error(run_muloco_here("export", fresh, out), "has no checkpoint yet")
    one_line_error(run_muloco_here("export", rms.run_dir, out, "--step", 999), "no checkpoint of step 999")
    one_line_error(run_muloco_here("eval", rms.run_dir, "--data", bpe_data), "another tokenizer")
    one_line_error(run_muloco_here("eval", tmp_path), "neither a run directory")
