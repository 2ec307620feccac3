"""The `muloco` CLI end to end: a tiny run, bad input (exit 2, one line, no traceback), Ctrl+C."""

import json
import signal
import time
from pathlib import Path

import pytest
from test_helpers import run_muloco as muloco
from test_helpers import start_muloco

ROOT = Path(__file__).resolve().parent.parent


def assert_clean_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_train_end_to_end_on_a_tiny_config(tmp_path, TINY):
    out = tmp_path / "runs"
    result = muloco("train", ROOT / "configs/quickstart.yaml", *TINY, f"run.output_dir={out}", "run.name=e2e")
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "e2e" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_val_loss"] < summary["initial_val_loss"]
    assert "kind=" not in result.stdout  # progress=off prints nothing on stdout
    assert "done status=completed" in result.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["missing.yaml"], ["config file not found", "missing.yaml"]),
        (["QS", "trian.total_tokens=5"], ["did you mean 'train'"]),
        (["QS", "workers=0"], ["workers"]),
        (["QS", "inner.lr=-1"], ["inner.lr"]),
        (["QS", "workers=3"], ["train.batch_tokens"]),
        (["QS", "data.source=text", "data.path=/nonexistent/corpus.txt"], ["data.path"]),
        (["QS", "data.source=tokens", "data.path=/nonexistent", "data.vocab_size=50000"], ["data.path"]),
        (["QS", "run.output_dir=/proc/version/x"], ["run.output_dir"]),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needles, TINY):
    args = [ROOT / "configs/quickstart.yaml" if a == "QS" else a for a in args]
    assert_clean_error(muloco("train", *args, *TINY), *needles)


def test_empty_text_data_is_a_clean_error(tmp_path, TINY):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = muloco(
        "train",
        ROOT / "configs/quickstart.yaml",
        *TINY,
        "data.source=text",
        f"data.path={empty}",
        f"run.output_dir={tmp_path}",
    )
    assert_clean_error(result, "data.path")


def test_corrupt_checkpoint_when_resuming_is_a_clean_error(tmp_path, TINY):
    ckpt = tmp_path / "bad.pt"
    ckpt.write_bytes(b"\x00not a checkpoint")
    result = muloco(
        "train",
        ROOT / "configs/quickstart.yaml",
        *TINY,
        f"run.output_dir={tmp_path}",
        f"checkpoint.resume={ckpt}",
    )
    assert_clean_error(result, "bad.pt")


@pytest.mark.slow
def test_sigint_checkpoints_and_exits_130(tmp_path, TINY):
    out = tmp_path / "runs"
    overrides = [
        *TINY,
        "train.total_tokens=400000",
        "method=dp",
        "logging.progress=lines",
        f"run.output_dir={out}",
        "run.name=run",
    ]
    proc = start_muloco("train", ROOT / "configs/quickstart.yaml", *overrides)
    try:
        assert proc.stdout.readline().startswith("kind=eval")  # training has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 130, stderr
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 0 < summary["inner_steps"] < 1562
    assert list((out / "run" / "checkpoints").glob("step_*.pt"))


def test_the_closing_hint_prompts_only_for_the_builtin_python_corpus(tmp_path, TINY, caplog):
    """`--prompt 'def '` fits the built-in corpus (Python source); other data gets no prompt."""
    from muloco.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat. " * 2000)
    base = ["train", str(ROOT / "configs/quickstart.yaml"), *TINY, f"run.output_dir={tmp_path / 'runs'}"]
    with caplog.at_level("INFO", logger="muloco"):
        assert main([*base, "run.name=builtin"]) == 0
        assert main([*base, "run.name=text", "data.source=text", f"data.path={text}"]) == 0
    hints = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sample from it")]
    assert hints[0].endswith("builtin --prompt 'def '") and hints[1].endswith("runs/text"), hints


def test_token_counts_are_written_in_the_unit_that_fits():
    from muloco.data.sources import _mtok

    assert [_mtok(n) for n in (512, 20480, 1_250_000, 123_456_789, 2_100_000_000)] == [
        "512",
        "20.5k",
        "1.25M",
        "123M",
        "2.1B",
    ]
