"""The WAN headline benchmark's --quick mode, so that the benchmark cannot rot (issue 36)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from muloco.net.wan import Link
from muloco.testbed.network import missing_requirements

ROOT = Path(__file__).resolve().parents[2]
REASON = missing_requirements()  # None: root and iproute2, the testbed can run
sys.path.insert(0, str(ROOT / "experiments/wan"))  # the benchmark's modules import each other by name


def _fake_curves(monkeypatch, bench_wan, needs: dict[str, float]) -> list[tuple[str, int]]:
    """Loopback runs replaced: a row ends at DDP's loss from its horizon in `needs` (x 100 steps) on. The
    list returned fills with each run's (row, steps)."""
    runs = []

    def fake_curve(row, steps, batch_tokens, workdir, eval_every, reuse):
        runs.append((row.key, steps))
        reached = steps / 100 >= needs[row.key]
        return {"summary": {"final_val_loss": 1.0 if reached else 1.5, "inner_steps": steps}, "evals": []}

    monkeypatch.setattr(bench_wan, "loopback_curve", fake_curve)
    return runs


def test_horizons_are_searched_shortest_longest_then_upwards(monkeypatch):
    """A row reaches DDP's loss from some horizon on: the search finds the shortest such of the grid,
    and a row that never does costs two runs (the shortest and the longest)."""
    import bench_wan
    from wan_rows import ROWS

    needs = {"ddp": 1.0, "ddp_bf16": 1.0, "muloco_4bit": 2.0, "diloco_fp32": 99.0}  # horizon that reaches
    runs = _fake_curves(monkeypatch, bench_wan, needs)
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


def test_an_expected_horizon_is_tried_first_and_the_search_still_finds_the_shortest(monkeypatch, tmp_path):
    """--expect-horizons: each row's earlier horizon first, then down the grid while it reaches or up until
    it does; the same shortest horizons as the search without it, in fewer runs where the guess holds."""
    import bench_wan
    from wan_rows import ROWS

    needs = {"ddp": 1.0, "ddp_bf16": 1.0, "muloco_4bit": 2.0, "muloco_fp32": 1.5, "diloco_fp32": 99.0}
    runs = _fake_curves(monkeypatch, bench_wan, needs)
    earlier = tmp_path / "earlier.json"
    # muloco_fp32's guess too long, diloco_fp32's too short, hivemind's absent (no curve of its own).
    horizons = {"muloco_4bit": 2.0, "muloco_fp32": 3.0, "diloco_fp32": 1.5, "ddp_bf16": 1.0}
    earlier.write_text(json.dumps({"curves": {k: {"horizon": h} for k, h in horizons.items()}}))
    keys = ("ddp", "muloco_4bit", "muloco_fp32", "diloco_fp32", "ddp_bf16")
    rows = [ROWS[k] for k in keys]
    expected = bench_wan.expected_horizons(earlier)
    assert bench_wan.expected_horizons(Path("none")) is None  # the grid search alone
    assert bench_wan.EXPECTED.exists()  # the default: the committed headline's horizons
    curves = bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, False, expected)
    assert runs == [
        ("ddp", 100),
        *[("muloco_4bit", s) for s in (200, 150, 100)],  # 100: its 1x run, the loss at DDP's tokens
        *[("muloco_fp32", s) for s in (300, 200, 150, 100)],
        *[("diloco_fp32", s) for s in (150, 200, 300, 100)],  # never: then run at DDP's horizon
        ("ddp_bf16", 100),
    ]
    searched = {k: (c["horizon"], c["steps"]) for k, c in curves.items()}
    assert searched == {
        "ddp": (1.0, 100),
        "muloco_4bit": (2, 200),
        "muloco_fp32": (1.5, 150),
        "diloco_fp32": (None, 100),
        "ddp_bf16": (1, 100),
    }
    runs.clear()
    assert {
        k: (c["horizon"], c["steps"])
        for k, c in bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, False).items()
    } == searched


def test_a_deferred_horizon_is_trained_by_the_first_link_and_searched_on_where_it_misses(monkeypatch):
    """The one command: a torch row's expected horizon is not trained on loopback when its next shorter
    misses; its first link run (the same losses) confirms it, or the search goes on upwards and the row
    runs again; a failed link run is trained on loopback. A twin that runs first keeps its row's search."""
    import bench_wan
    from wan_rows import ROWS

    needs = {"ddp": 1.0, "muloco_4bit": 2.0, "muloco_fp32": 1.5, "diloco_fp32": 3.0}
    runs = _fake_curves(monkeypatch, bench_wan, needs)
    keys = ("ddp", "muloco_4bit", "torchft_4bit", "muloco_fp32", "diloco_fp32")
    rows = [ROWS[k] for k in keys]
    deferred = bench_wan.first_link_curves(rows, rows)
    assert deferred == {"muloco_4bit", "muloco_fp32", "diloco_fp32"}  # not DDP's, not a twin's
    twin_first = [ROWS[k] for k in ("ddp", "torchft_4bit", "muloco_4bit")]
    assert bench_wan.first_link_curves(twin_first, twin_first) == frozenset()
    assert bench_wan.first_link_curves(rows, rows[:2]) == {"muloco_4bit"}  # only rows on the first link

    expected = {"muloco_4bit": 2.0, "muloco_fp32": 2.0, "diloco_fp32": 2.0}  # diloco's guess too short
    curves = bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, False, expected, deferred)
    assert runs == [
        ("ddp", 100),
        *[("muloco_4bit", s) for s in (150, 100)],  # 150 misses: 200 is the first link's
        *[("muloco_fp32", s) for s in (150, 100)],  # 150 reaches: searched here as before
        *[("diloco_fp32", s) for s in (150, 100)],
    ]
    assert {k for k, c in curves.items() if "confirm" in c} == {"muloco_4bit", "diloco_fp32"}
    assert curves["muloco_4bit"]["steps"] == 200 and curves["muloco_4bit"]["chosen"] is None
    assert curves["muloco_fp32"]["horizon"] == 1.5 and "confirm" not in curves["muloco_fp32"]

    runs.clear()
    kept = []
    monkeypatch.setattr(bench_wan, "keep_as_curve", lambda row, steps, *rest: kept.append((row.key, steps)))
    link_run = {"summary": {"final_val_loss": 1.0, "inner_steps": 200}, "evals": [], "over_link": True}
    assert bench_wan.confirm_on_link(curves, "muloco_4bit", link_run)  # it stands: no run here
    held = curves["muloco_4bit"]
    assert runs == [] and held["chosen"] is link_run and held["horizon"] == 2 and "confirm" not in held
    assert kept == [("muloco_4bit", 200)]  # with the loopback runs, for --reuse-curves
    assert held["local"]["summary"]["inner_steps"] == 150  # the planner's local cost: a loopback run's
    missed = {"summary": {"final_val_loss": 1.5, "inner_steps": 200}, "evals": []}
    assert not bench_wan.confirm_on_link(curves, "diloco_fp32", missed)  # up the grid; runs again at 300
    assert runs == [("diloco_fp32", 300)] and curves["diloco_fp32"]["steps"] == 300
    assert [r["summary"]["inner_steps"] for r in curves["diloco_fp32"]["runs"]] == [100, 150, 200, 300]

    curves = bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, False, expected, deferred)
    runs.clear()
    assert not bench_wan.confirm_on_link(curves, "muloco_4bit", None)  # its link run failed
    assert runs == [("muloco_4bit", 200)] and curves["muloco_4bit"]["horizon"] == 2

    def failing_curve(*args):
        raise RuntimeError("diloco_fp32_300 failed on loopback")

    monkeypatch.setattr(bench_wan, "loopback_curve", failing_curve)  # the upward search's run fails:
    assert bench_wan.confirm_on_link(curves, "diloco_fp32", missed)  # the link's run stands, unconfirmed
    assert "confirm" not in curves["diloco_fp32"] and curves["diloco_fp32"]["steps"] == 200


def test_reused_curves_start_each_search_at_the_shortest_completed_run_that_reached(monkeypatch):
    """--reuse-curves without --expect-horizons: where a completed run reaches DDP's loss the search starts
    there (it once trained 3x runs the curves phase had skipped); a row with none searches the grid."""
    import bench_wan
    from wan_rows import ROWS

    needs = {"ddp": 1.0, "muloco_4bit": 1.5, "ddp_bf16": 1.0}
    runs = _fake_curves(monkeypatch, bench_wan, needs)
    completed = {("muloco_4bit", 100): 1.5, ("muloco_4bit", 150): 1.0}  # (row, steps) -> final val loss

    def fake_completed(row, steps, batch_tokens, workdir, eval_every):
        final = completed.get((row.key, steps))
        return None if final is None else {"summary": {"final_val_loss": final, "inner_steps": steps}}

    monkeypatch.setattr(bench_wan, "completed_curve", fake_completed)
    rows = [ROWS[k] for k in ("ddp", "muloco_4bit", "ddp_bf16")]
    curves = bench_wan.find_horizons(rows, 100, [1, 1.5, 2, 3], Path("unused"), 45, True)
    assert runs == [("ddp", 100), ("muloco_4bit", 150), ("muloco_4bit", 100), ("ddp_bf16", 100)]
    assert {k: c["horizon"] for k, c in curves.items()} == {"ddp": 1.0, "muloco_4bit": 1.5, "ddp_bf16": 1}


def test_results_run_one_link_at_a_time_merge_into_one_table():
    """`merge_results.py`: links and rows of runs made link by link (--ratios 50, then --ratios 5) in one
    file; parts from different curves (another target) are refused rather than mixed."""
    from merge_results import merge

    def part(ratio, target=1.29):
        link = {"ratio": ratio, "label": f"link {ratio}"}
        return {
            "command": f"--ratios {ratio}",
            "target_val_loss": target,
            "links": [link],
            "rows": [{"key": "ddp", "link_label": link["label"]}],
            "curves": {},
            "bench_s": 10.0,
        }

    merged = merge([part(50), part(5)])
    assert [link["ratio"] for link in merged["links"]] == [50, 5]
    assert [r["link_label"] for r in merged["rows"]] == ["link 50", "link 5"]
    assert merged["commands"] == ["--ratios 50", "--ratios 5"] and merged["bench_s"] == 20.0
    with pytest.raises(ValueError, match="different curves"):
        merge([part(50), part(5, target=1.3)])
    # A row run again over the same link replaces its earlier run; the rerun's own DDP window does not.
    again = part(50)
    again["rows"] = [
        {"key": "ddp", "link_label": "link 50", "new": 1},
        {"key": "x", "link_label": "link 50", "new": 1},
    ]
    before = part(50)
    before["rows"].append({"key": "x", "link_label": "link 50"})
    merged = merge([before, part(5)], (again,))
    assert [(r["key"], r.get("new")) for r in merged["rows"]] == [("ddp", None), ("x", 1), ("ddp", None)]
    with pytest.raises(ValueError, match="no part has"):
        merge([part(5)], (again,))


def test_a_part_with_more_rows_over_a_link_is_compared_with_its_own_ddp_windows(
    tmp_path, capsys, monkeypatch
):
    """merge_results + the report: a later part's rows over a link an earlier part ran join that link;
    each is compared with the DDP window of its own part and repeat (the one interleaved with it), which
    is kept as its reference only (not a second DDP in the tables); the same row in two parts is refused.
    The loss at equal tokens is each row's run of DDP's length, "-" where its search did not train one."""
    import bench_wan
    from merge_results import merge

    def runs(*finals: tuple[int, float]) -> dict:
        return {"horizon": 1.0, "runs": [{"steps": steps, "final_val_loss": loss} for steps, loss in finals]}

    curves = {"ddp": runs((100, 1.29)), "muloco_4bit": runs((100, 1.34), (150, 1.27))}
    curves["diloco_fp32"] = runs((200, 1.34), (300, 1.27))  # found at 3x from an expected horizon

    def part(rows: dict[str, list[float]]) -> dict:
        link = {"ratio": 5, "label": "L", "rate_mbit": 40.0, "delay_ms": 6.0}
        table_cells = {"per_step": False, "steps_to_target": 1, "wait_fraction": 0.1, "evals": []}
        table_cells.update(ratio=link["ratio"], rate_mbit=link["rate_mbit"], delay_ms=link["delay_ms"])
        table_cells.update(bytes_to_target=1.0, wire_to_target=1.0)
        made = [
            {"key": key, "label": key, "link_label": "L", "repeat": i, "s_to_target": s, **table_cells}
            for key, seconds in rows.items()
            for i, s in enumerate(seconds)
        ]
        return {
            "command": str(list(rows)),
            "target_val_loss": 1.29,
            "links": [link],
            "rows": made,
            "curves": curves,
        }

    first, second = (
        part({"ddp": [100, 200], "muloco_4bit": [50, 60]}),
        part({"ddp": [400, 300], "diloco_fp32": [100, 90]}),
    )
    merged = merge([first, second])
    assert len(merged["links"]) == 1
    assert [(r["key"], r["part"], r.get("reference", False)) for r in merged["rows"][::2]] == [
        ("ddp", 0, False),
        ("muloco_4bit", 0, False),
        ("ddp", 1, True),
        ("diloco_fp32", 1, False),
    ]
    monkeypatch.setattr(bench_wan, "planner_s", lambda row, link: None)  # the planner has its own tests
    args = argparse.Namespace(out=tmp_path / "merged.json", markdown=True, plots=None)
    bench_wan.report(merged, args, runs_s=None)
    vs = {(r["key"], r["repeat"]): r["vs_ddp"] for r in merged["rows"] if r["key"] != "ddp"}
    assert vs == {
        ("muloco_4bit", 0): 0.5,
        ("muloco_4bit", 1): 0.3,
        ("diloco_fp32", 0): 0.25,
        ("diloco_fp32", 1): 0.3,
    }
    table = capsys.readouterr().out
    assert "| L | ddp | 150 (100-200) |" in table  # the medians
    assert table.count("| L | ddp |") == 3  # repeat 0, the medians, the headline
    assert "| L | muloco_4bit | 50 | 0.500x | - | - | 1 | 1.3400 |" in table  # no per-step baseline: no best
    assert "| L | diloco_fp32 | 100 | 0.250x | - | - | 1 | - |" in table
    with pytest.raises(ValueError, match="in two parts"):
        merge([first, part({"ddp": [1], "muloco_4bit": [1]})])
    # Parts run with other --rows have other curve rows: the merged file has each (its 1x run read above).
    only_4bit = {**first, "curves": {"ddp": curves["ddp"], "muloco_4bit": curves["muloco_4bit"]}}
    only_diloco = {**second, "curves": {"ddp": curves["ddp"], "diloco_fp32": curves["diloco_fp32"]}}
    assert set(merge([only_4bit, only_diloco])["curves"]) == {"ddp", "muloco_4bit", "diloco_fp32"}
    with pytest.raises(ValueError, match="other losses"):
        merge([only_4bit, {**second, "curves": {"ddp": runs((100, 1.30))}}])
    # --curves: the same curves with more runs trained since (DiLoCo's 1x) replace the parts'.
    more = {**curves, "diloco_fp32": runs((100, 1.55), (200, 1.34), (300, 1.27))}
    merged = merge([first, second], curves={"target_val_loss": 1.29, "curves": more})
    assert merged["curves"]["diloco_fp32"]["runs"][0] == {"steps": 100, "final_val_loss": 1.55}
    with pytest.raises(ValueError, match="other horizons"):
        merge([first, second], curves={"target_val_loss": 1.29, "curves": {**more, "ddp": {"horizon": 2.0}}})


def test_the_headline_takes_each_method_at_each_ratio_from_the_first_part_and_its_own_ddp(monkeypatch):
    """Merged parts from machines of other speeds solve the same ratio to other links: the headline keeps
    one part's runs per method and ratio (the first that ran it), and its speed-up line is drawn against
    the DDP window of that part, not of another machine's."""
    import wan_report

    def row(key, part, ratio=50, repeat=0, seconds=100.0, **extra):
        return {"key": key, "part": part, "ratio": ratio, "repeat": repeat, "s": seconds, **extra}

    rows = [
        row("ddp", 0, seconds=1000.0),
        row("muloco_4bit", 0, seconds=50.0),
        row("ddp", 1, seconds=800.0, reference=True),
        row("muloco_4bit", 1, seconds=45.0),  # again on part 1's machine: not the headline's
        row("hivemind_4bit", 1, seconds=80.0),
        row("ddp", 0, ratio=5, seconds=100.0),
        row("muloco_4bit", 0, ratio=5, seconds=30.0),
    ]
    heads = wan_report.headline_rows(rows)
    assert [(r["key"], r["part"], r["ratio"]) for r in heads] == [
        ("ddp", 0, 50),
        ("muloco_4bit", 0, 50),
        ("hivemind_4bit", 1, 50),
        ("ddp", 0, 5),
        ("muloco_4bit", 0, 5),
    ]
    monkeypatch.setattr(wan_report, "planner_s", lambda r, link: r["s"])  # the planner has its own tests
    curves = wan_report.headline_speedups(rows, 50, [1.0, 10.0], 20.0)
    assert curves == {"ddp": [1.0, 1.0], "muloco_4bit": [20.0, 20.0], "hivemind_4bit": [10.0, 10.0]}


def test_repeats_are_compared_within_each_repeat_and_summarized_by_median_and_spread():
    """--repeats: each row's ratio to DDP uses the DDP window of its own repeat (they ran side by side),
    and the summary gives the median with min-max; a repeat that did not reach the target is counted."""
    from wan_report import format_repeats

    rows = []
    for repeat, (ddp_s, mine_s) in enumerate([(100.0, 10.0), (200.0, 30.0), (120.0, None)]):
        for key, seconds in (("ddp", ddp_s), ("mine", mine_s)):
            row = {"key": key, "label": key, "link_label": "L", "repeat": repeat, "s_to_target": seconds}
            row["per_step"] = key == "ddp"
            rows.append({**row, "wait_fraction": 0.1 * (repeat + 1)})
            rows[-1]["vs_ddp"] = None if seconds is None else seconds / ddp_s
            if key == "mine":  # the columns given as medians: steps, losses, MB (counted, wire)
                rows[-1].update(steps_to_target=1500 + 10 * repeat, val_equal_tokens=1.34, val_equal_wall=1.3)
                rows[-1].update(bytes_to_target=2e6 * (repeat + 1), wire_to_target=3e6)
    table = format_repeats(rows)
    assert (
        "| L | ddp | 120 (100-200) (window) | 1.000x (1.000x-1.000x) | - | - | 20.0% (10.0%-30.0%) | - | - "
        "| - | - | - | - |" in table
    )
    mine = "| L | mine | 20 (10-30, 1 not reached) | 0.125x (0.100x-0.150x, 1 not reached) | - | - | 20.0% "
    assert mine + "(10.0%-30.0%) | - | 1,510 | 1.3400 | 1.3000 | 4.0, 3.0 | - |" in table


def test_each_row_is_compared_with_the_fastest_baseline_beside_it():
    """vs best DDP: the fastest per-step row (DDP, + bf16, + PowerSGD) that reached DDP's loss in the same
    repeat; none where no baseline reached it."""
    import bench_wan

    here = [
        {"key": "ddp", "per_step": True, "s_to_target": 300.0},
        {"key": "ddp_bf16", "per_step": True, "s_to_target": 200.0},
        {"key": "ddp_powersgd", "per_step": True, "s_to_target": None},
        {"key": "muloco_4bit", "per_step": False, "s_to_target": 20.0},  # faster, but not a baseline
    ]
    assert bench_wan.fastest_baseline(here)["key"] == "ddp_bf16"
    assert bench_wan.fastest_baseline([here[2], here[3]]) is None


def test_a_link_is_re_solved_until_ddp_measures_its_ratio(monkeypatch, tmp_path):
    """--solve-within: the model's rate gives DDP a ratio off by what it leaves out; each try scales the
    rate by measured / named until a DDP window measures within the tolerance, and the link keeps its
    tries and its new label."""
    import bench_wan

    compute = 0.04  # s per DDP step on loopback
    # The link as measured: 16 Mbit per step at the rate, plus a fixed 30 ms the model leaves out.
    step_s = {}

    class FakeTestbed:
        def __init__(self, workers, rate_mbit, delay_ms):
            self.rate_mbit = rate_mbit

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_run(testbed, row, curves, args):
        assert row.key == "ddp"
        step_s[testbed.rate_mbit] = compute + 16 / testbed.rate_mbit + 0.03
        return {"step_s_median": step_s[testbed.rate_mbit]}

    monkeypatch.setattr(bench_wan, "Testbed", FakeTestbed)
    monkeypatch.setattr(bench_wan, "run_over", fake_run)
    curves = {"ddp": {"chosen": {"summary": {"worker_compute_s": compute * 100, "inner_steps": 100}}}}
    link = {"ratio": 5.0, "rate_mbit": 80.0, "delay_ms": 6, "label": "80 Mbit/s 6 ms"}
    bench_wan.solve_rate(link, curves, argparse.Namespace(solve_within=0.05))
    measured = [t["ratio_measured"] for t in link["solve_tries"]]
    assert measured[0] == pytest.approx((16 / 80 + 0.03) / compute, abs=1e-3)  # 5.75: 15% off
    assert len(measured) > 1 and abs(measured[-1] / 5 - 1) <= 0.05
    assert all(abs(m / 5 - 1) > 0.05 for m in measured[:-1])
    assert link["rate_mbit"] == link["solve_tries"][-1]["rate_mbit"] > 80
    assert link["label"] == f"{link['rate_mbit']:.3g} Mbit/s 6 ms"


def test_the_planner_check_counts_each_rows_loopback_collectives_once():
    """wan_report: every row's loopback run has its collectives in the committed loopback probe (DDP's and
    the hooks' all-reduces, the engine's transport; torchft its twin's; hivemind none), and a per-step
    row's planner time is its loopback step plus what the link takes beyond the loopback all-reduce."""
    import wan_report
    from wan_rows import ROWS

    measured = wan_report.loopback_op_s()
    for key, row in ROWS.items():
        result = {"key": key, "per_step": row.per_step}  # a result row, as far as the term reads it
        ops = wan_report.LOOPBACK_OPS.get(key, wan_report.LOOPBACK_OPS[row.curve_row])
        assert all((op, 0.03 if row.per_step else 0.5) in measured for op in ops)
        assert (wan_report.loopback_transfer_s(result) > 0) == (key != "hivemind_4bit")
    powersgd = wan_report.loopback_transfer_s({"key": "ddp_powersgd", "per_step": True})
    assert powersgd == pytest.approx(
        sum(measured[(op, 0.03)] for op in wan_report.LOOPBACK_OPS["ddp_powersgd"])
    )
    ddp = {"key": "ddp", "per_step": True, "backend": "torch", "transport": "all_reduce", "overlap": 0}
    ddp.update(step_compute_s=0.03, local_s_per_sync=0.02, steps_to_target=10, run_steps=10, run_syncs=10)
    ddp["run_bytes_per_worker"] = 10 * 1.1e6
    c = wan_report.loopback_transfer_s(ddp)
    slow, fast = Link(10, 20), Link(1e5, 0)
    assert wan_report.planner_s(ddp, fast) == pytest.approx(10 * (0.03 + 0.02))  # the loopback run's time
    transfer = max(8 * 1.1e6 / (10e6 * slow.efficiency), 8 * slow.round_trip_s)
    assert wan_report.planner_s(ddp, slow) == pytest.approx(10 * (0.05 - c + transfer))


@pytest.mark.parametrize("key", ["ddp", "ddp_powersgd", "muloco_4bit", "streaming_4bit", "hivemind_4bit"])
def test_the_reports_planner_time_is_net_wans_for_a_committed_row(key):
    """wan_report.planner_s is muloco.net.wan's model fed a row's measurements, not a model of its own: a
    committed headline row's planner time is wall_clock of the Workload built from net.wan's round trips,
    reduce-scatter shares and pro-rata cut (what the report adds: which fields and which probes)."""
    import wan_report

    from muloco.net.wan import Workload, pro_rata, reduce_scatter_shares, sync_round_trips, wall_clock

    saved = json.loads((ROOT / "experiments/wan/results/wan_headline.json").read_text())
    row = next(r for r in saved["rows"] if r["key"] == key and r["steps_to_target"])
    link = Link(row["rate_mbit"], row["delay_ms"])
    syncs, per_sync = pro_rata(
        row["steps_to_target"], row["run_steps"], row["run_syncs"], row["run_bytes_per_worker"]
    )
    round_trips, serial, local, phases = 0, 0.0, row["local_s_per_sync"], ()
    if row["per_step"]:
        round_trips = row.get("allreduces_per_step", 1) * sync_round_trips("all_reduce", 4)
    elif row["backend"] == "hivemind":
        probe = json.loads(wan_report.HIVEMIND_PROBE.read_text())
        serial, local = probe["round_trips"], probe["local_s"]
    else:
        round_trips = sync_round_trips(row["transport"], 4)
        if row["transport"] == "reduce_scatter":
            phases = reduce_scatter_shares(4, 4, 8)  # 4-bit parts, 8-bit means (DEFAULT_MEAN_BITS)
    work = Workload(
        steps=row["steps_to_target"],
        step_compute_s=row["step_compute_s"],
        syncs=syncs,
        bytes_per_sync=per_sync,
        round_trips_per_sync=round_trips,
        hidden_steps=row["overlap"],
        serial_round_trips_per_sync=serial,
        local_s_per_sync=local,
        phases=phases,
        loopback_transfer_s=wan_report.loopback_transfer_s(row),
    )
    assert wan_report.planner_s(row, link) == wall_clock(work, link)
    assert wan_report.to_target_workload(row) == work


def test_links_are_solved_byte_bound_and_a_delay_too_long_for_the_ratio_is_lowered():
    """calibrate_links.link_for: the rate at which net/wan's all-reduce takes ratio x compute, its bytes
    setting the time; a latency whose 2K round trips exceed half of that time is refused with the largest
    whole-ms one that fits."""
    from calibrate_links import link_for

    from muloco.net.wan import allreduce_seconds

    gradients = 4 * 1e6  # 1M fp32 parameters, K = 4: 6 MB per worker
    fits = link_for(50, 0.02, gradients, 4, 5.0)  # 1 s; 8 round trips of 10 ms: 0.08 s
    assert fits["rate_mbit"] == pytest.approx(8 * 6e6 / (1448 / 1514) / 1e6)
    assert fits["latency_share"] == pytest.approx(0.08)
    solved = Link(fits["rate_mbit"], 5.0)
    assert allreduce_seconds(solved, gradients, 4) == pytest.approx(50 * 0.02)  # the model says 1 s back
    refused = link_for(5, 0.02, gradients, 4, 20.0)  # 0.1 s, but 8 round trips of 40 ms: 0.32 s
    assert refused["rate_mbit"] is None
    assert refused["latency_ms_max"] == 3  # 8 x 2 x 3 ms = 48 ms <= 50 ms; 4 ms would be 64 ms
    assert refused["compute_s_needed"] == pytest.approx(2 * 0.32 / 5)


# Time (~100 s alone, up to 170 s beside another file): DDP's and MuLoCo 4-bit's 60-step curves on
# loopback, then DDP's window and MuLoCo's 120 steps (its 2x) over one 4-host link (ratio 50, 20 ms one way),
# then those 120 steps on loopback too (the premise of the deferral).
@pytest.mark.slow(seconds=150)
@pytest.mark.skipif(REASON is not None, reason=f"the testbed: {REASON}")
def test_the_quick_benchmark_measures_both_rows_over_one_link(tmp_path):
    out = tmp_path / "wan.json"
    cmd = [sys.executable, "experiments/wan/bench_wan.py", "--quick", "--workdir", str(tmp_path / "runs")]
    done = subprocess.run(
        [*cmd, "--out", str(out), "--plots", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.read_text())
    (link,) = saved["links"]
    assert link["ratio"] == 50 and link["delay_ms"] == 20
    rows = {r["key"]: r for r in saved["rows"]}
    assert set(rows) == {"ddp", "muloco_4bit"}
    ddp, muloco = rows["ddp"], rows["muloco_4bit"]
    # DDP's own final loss is the target: its curve reaches it at its last step, timed from its window.
    assert ddp["steps_to_target"] == 60 and ddp["window_steps"] == 6
    assert ddp["s_to_target"] == pytest.approx(ddp["step_s"] * 60)
    assert (
        ddp["ratio_measured"] > 5 and 0.5 < ddp["wait_fraction"] < 1
    )  # the link, not compute, sets its pace
    assert ddp["vs_ddp"] == 1
    # MuLoCo's clock is its own run's over the link, and it sends far fewer bytes.
    assert muloco["evals"] and all(e["clock_s"] >= 0 for e in muloco["evals"])
    assert muloco["run_bytes_per_worker"] < ddp["run_bytes_per_worker"] / 10
    assert (tmp_path / "wan_speedup.png").stat().st_size > 0
    # Its 1x run on loopback misses DDP's loss; its 2x run, over the link, is its curve's (deferred).
    curve = saved["curves"]["muloco_4bit"]
    assert curve["horizon"] == 2 and [r["steps"] for r in curve["runs"]] == [60, 120]
    # The premise: a torch row's losses over the link are its loopback losses, bit for bit.
    from wan_rows import ROWS
    from wan_runs import loopback_curve

    loopback = loopback_curve(ROWS["muloco_4bit"], 120, 2048, tmp_path / "loopback", 15)
    assert [e["val_loss"] for e in loopback["evals"]] == [e["val_loss"] for e in muloco["evals"]]
    assert muloco["val_equal_tokens"] == curve["runs"][0]["final_val_loss"] > saved["target_val_loss"]
