"""The WAN headline's rows run at the lrs their committed tune found (configs/sweeps/wan_tune*.yaml), so a
row's lr cannot drift from the sweep that justifies it (issue 60: every figure traceable to its JSON)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments/wan/results"
sys.path.insert(0, str(ROOT / "experiments/wan"))


def _best(source: str, settings: dict, side: str) -> dict:
    """The best settings of the tuned.json row whose `side` ("cell" or "dp") matches `settings`."""
    rows = json.loads((RESULTS / source / "tuned.json").read_text())["rows"]
    cells = [r[side] for r in rows if r[side] is not None and settings.items() <= r[side]["settings"].items()]
    assert len(cells) == 1, f"{source}: {len(cells)} tuned rows match {settings} ({side})"
    return cells[0]["best"]


@pytest.mark.parametrize(
    "row, source, settings, side, field, key",
    [
        ("ddp", "wan_tune", {"inner.optimizer": "muon"}, "dp", "inner.lr", "inner.lr"),
        ("muloco_4bit", "wan_tune", {"inner.optimizer": "muon"}, "cell", "inner.lr", "inner.lr"),
        ("diloco_fp32", "wan_tune", {"inner.optimizer": "adamw"}, "cell", "inner.adamw.lr", "inner.adamw.lr"),
        # wan_tune_hooks is a sweep of DP runs only: the report's cells are its runs
        ("ddp_bf16", "wan_tune_hooks", {"dp.comm_hook": "bf16"}, "cell", "inner.lr", "inner.lr"),
        ("ddp_powersgd", "wan_tune_hooks", {"dp.comm_hook": "powersgd"}, "cell", "inner.lr", "inner.lr"),
    ],
)
def test_each_row_runs_at_its_tuned_lr(row, source, settings, side, field, key):
    from wan_rows import ROWS

    best = _best(source, settings, side)[key]
    assert float(ROWS[row].override(field)) == best, f"{row}: {field} vs the best of {source}"
