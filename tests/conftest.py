import os
import signal

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# A model and budget small enough that a whole run takes about a second on 2 CPU cores.
TINY = [
    "model.preset=nano",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.seq_len=32",
    "train.batch_tokens=256",
    "train.total_tokens=3072",
    "train.eval_every=4",
    "train.eval_tokens=512",
    "train.warmup_steps=2",
    "logging.progress=off",
    "sync.every=3",
]


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tests are small: one thread is faster and deterministic
    yield


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Each test leaves SIGINT/SIGTERM as it found them (hivemind's averagers, for one, set SIGINT to
    ignore in the process that starts them), so Ctrl+C keeps working for the rest of the session."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(name="TINY")
def tiny_args():
    """The tiny overrides, without an output directory (for CLI tests)."""
    return list(TINY)


@pytest.fixture
def tiny(tmp_path):
    """Overrides for a tiny run writing under tmp_path."""
    return [*TINY, f"run.output_dir={tmp_path / 'runs'}"]
