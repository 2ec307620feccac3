"""The WAN headline's rows run at the lrs (and outer settings) their committed tune found
(configs/sweeps/wan_tune*.yaml), so a row's lr cannot drift from the sweep that justifies it (issue 60: every
figure traceable to its JSON)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments/wan/results"
sys.path.insert(0, str(ROOT / "experiments/wan"))


WINDOW, EAGER, NAIVE = "muloco_4bit_window", "muloco_4bit_eager", {"sync.eager": False}
OUTER = ("outer.lr", "outer.momentum")


def _tuned(source: str, settings: dict, side: str) -> dict:
    """The tuned.json row whose `side` ("cell" or "dp") matches `settings` (a setting the sweep fixed, not
    among the row's settings, is taken as matching: wan_tune_overlap_naive fixes sync.eager)."""
    rows = json.loads((RESULTS / source / "tuned.json").read_text())["rows"]
    found = [
        r
        for r in rows
        if r[side] is not None and all(r[side]["settings"].get(k, v) == v for k, v in settings.items())
    ]
    assert len(found) == 1, f"{source}: {len(found)} tuned rows match {settings} ({side})"
    return found[0]


def _best(source: str, settings: dict, side: str) -> dict:
    """The best settings of one tune, or of several ("a+b": the grid extended by a second sweep, the
    lowest final val loss of their bests)."""
    tuned = [_tuned(part, settings, side) for part in source.split("+")]
    return min(tuned, key=lambda row: row["final_val_loss"])[side]["best"]


@pytest.mark.parametrize(
    "row, source, settings, side, field, key",
    [
        ("ddp", "wan_tune", {"inner.optimizer": "muon"}, "dp", "inner.lr", "inner.lr"),
        ("muloco_4bit", "wan_tune", {"inner.optimizer": "muon"}, "cell", "inner.lr", "inner.lr"),
        ("diloco_fp32", "wan_tune", {"inner.optimizer": "adamw"}, "cell", "inner.adamw.lr", "inner.adamw.lr"),
        # wan_tune_hooks is a sweep of DP runs only: the report's cells are its runs
        ("ddp_bf16", "wan_tune_hooks", {"dp.comm_hook": "bf16"}, "cell", "inner.lr", "inner.lr"),
        ("ddp_powersgd", "wan_tune_hooks", {"dp.comm_hook": "powersgd"}, "cell", "inner.lr", "inner.lr"),
        # the whole-window rows' outer settings (issue 59), per variant; wan_tune_overlap_naive extends the
        # naive row's momentum below the first grid's edge (0.3)
        *[(WINDOW, "wan_tune_overlap+wan_tune_overlap_naive", NAIVE, "cell", k, k) for k in OUTER],
        *[(EAGER, "wan_tune_overlap", {"sync.eager": True}, "cell", k, k) for k in OUTER],
        # the sparse row (issue 61) at the better of the two outer rules its tune compares
        ("muloco_sparse", "wan_tune_sparse", {"outer.momentum": 0.0}, "cell", "outer.lr", "outer.lr"),
    ],
)
def test_each_row_runs_at_its_tuned_lr(row, source, settings, side, field, key):
    from wan_rows import ROWS

    best = _best(source, settings, side)[key]
    assert float(ROWS[row].override(field)) == best, f"{row}: {field} vs the best of {source}"
