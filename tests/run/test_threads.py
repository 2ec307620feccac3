"""train.threads unset on a busy machine: torch's choice is kept, and one warning names the setting."""

import logging
import subprocess
import sys

import torch

from muloco.run import threads


def test_a_busy_machine_gets_one_warning_naming_train_threads(monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)  # one CPU burner
    torch.set_num_threads(2)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        threads.set_threads(None, torch.device("cpu"))
    assert torch.get_num_threads() == 2  # torch's choice, kept
    assert "1.0 of 2 cores in use" in caplog.text and "set train.threads=1" in caplog.text


def test_an_idle_machine_or_explicit_threads_get_no_warning(monkeypatch, caplog):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.1)
    torch.set_num_threads(2)
    with caplog.at_level(logging.WARNING, logger="muloco"):
        threads.set_threads(None, torch.device("cpu"))
        monkeypatch.setattr(threads, "busy_cores", lambda: 9.0)
        threads.set_threads(1, torch.device("cpu"))
    assert torch.get_num_threads() == 1 and caplog.text == ""


def test_busy_cores_sees_a_cpu_burner():
    """The measure itself, against a real burner: at least half a core more in use while it spins (a
    lower bound only: the machine may be busy with other tests too)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads.busy_cores() >= 0.5
    finally:
        burner.kill()
        burner.wait()
