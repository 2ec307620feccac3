"""The WAN headline benchmark's --quick mode, so that the benchmark cannot rot (issue 36)."""

import sys
from pathlib import Path

from muloco.net.testbed import missing_requirements

ROOT = Path(__file__).resolve().parents[2]
REASON = missing_requirements()
sys.path.insert(0, str(ROOT / "experiments/wan"))  # the benchmark's modules import each other by name


def test_horizons_are_searched_shortest_longest_then_upwards(monkeypatch):
    """A row reaches DDP's loss from some horizon on: the search finds the shortest such of the grid,
    and a row that never does costs two runs (the shortest and the longest)."""
    import bench_wan
    from wan_rows import ROWS

    needs = {"ddp": 1.0, "ddp_bf16": 1.0, "muloco_4bit": 2.0, "diloco_fp32": 99.0}  # horizon that reaches
    runs = []

    def fake_curve(row, steps, batch_tokens, workdir, eval_every, reuse):
        runs.append((row.key, steps))
        reached = steps / 100 >= needs[row.key]
        return {"summary": {"final_val_loss": 1.0 if reached else 1.5, "inner_steps": steps}, "evals": []}

    monkeypatch.setattr(bench_wan, "loopback_curve", fake_curve)
    rows = [ROWS[k] for k in ("ddp", "muloco_4bit", "diloco_fp32", "ddp_bf16", "hivemind_4bit")]
    curves = bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, False)
    assert runs == [
        ("ddp", 100),
        *[("muloco_4bit", s) for s in (100, 300, 150, 200)],  # hivemind_4bit: its torch twin's curve
        *[("diloco_fp32", s) for s in (100, 300)],
        ("ddp_bf16", 100),
    ]
    assert {k: (c["horizon"], c["steps"]) for k, c in curves.items()} == {
        "ddp": (1.0, 100),
        "muloco_4bit": (2, 200),
        "diloco_fp32": (None, 100),  # run over the links at DDP's horizon: its time and loss there
        "ddp_bf16": (1, 100),
    }
