"""Shared by the sweep tests: a sweep-file writer and a stand-in for `muloco train`."""

import json
from pathlib import Path

import pytest
import yaml

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


@pytest.fixture
def write_sweep(tmp_path):
    """write_sweep(body, name) -> the path of a sweep file under tmp_path: the quickstart base, runs under
    tmp_path/out, then `body`."""

    def write(body: dict, name="sweep.yaml") -> Path:
        body = {"base": str(QUICKSTART), "output_dir": str(tmp_path / "out"), **body}
        path = tmp_path / name
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        return path

    return write


class FakeProcess:
    """A finished `muloco train`: writes the summary.json a run with this exit code leaves, no training."""

    def __init__(self, run_dir: Path, code: int):
        status = "completed" if code == 0 else "failed"
        (run_dir / "summary.json").write_text(json.dumps({"status": status, "final_val_loss": 1.0}))
        self.code = code

    def poll(self):
        return self.code


@pytest.fixture(name="FakeProcess")
def fake_process_class():
    return FakeProcess
