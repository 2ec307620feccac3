import os
import signal
from collections import Counter

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


MAX_TEST_WORKERS = 4  # each multi-process test starts 2-5 processes; more files at once oversubscribe


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per core, at most MAX_TEST_WORKERS."""
    return max(1, min(MAX_TEST_WORKERS, os.cpu_count() or 1))


SLOW_TEST_S = 10  # a slow test's time unless its marker says otherwise: @pytest.mark.slow(seconds=90)


def pytest_collection_modifyitems(config, items):
    """The files with the longest slow (multi-process) tests first: xdist's loadfile hands out files in
    this order, so the long ones start at once and the quick in-process files fill the gaps at the end,
    instead of a long file starting last and running alone (longest-processing-time-first scheduling)."""
    seconds: Counter = Counter()
    for item in items:
        if marker := item.get_closest_marker("slow"):
            seconds[item.path] += marker.kwargs.get("seconds", SLOW_TEST_S)
    items.sort(key=lambda item: -seconds[item.path])  # stable: a file's tests keep their order


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
