"""The tuned comparison (muloco/tools/tuning.py) on a synthetic sweep whose numbers are checked by hand:
each method at its best lr per K, against DP at its own best lr, over paired seeds."""

import json

import pytest
from test_helpers import run_muloco_here
from tools.test_report import QUICKSTART, assert_png, fake_run

from muloco.sweep.main import sweep_record
from muloco.sweep.spec import parse_sweep
from muloco.tools.report import SWEEP_RECORD, build_report, recorded_tune
from muloco.tools.tuning import TuneSpec

# (optimizer, method, workers, inner.lr, seed) -> final val loss. The study's pattern: every lr on seed 0,
# then the winner repeated on seed 1; NAdam ran every lr on both seeds.
LOSSES = {
    ("muon", "diloco", 4, 0.01, 0): 3.10,
    ("muon", "diloco", 4, 0.02, 0): 3.00,  # best at K = 4 (chosen on seed 0)
    ("muon", "diloco", 4, 0.04, 0): 3.05,
    ("muon", "diloco", 4, 0.02, 1): 3.02,
    ("muon", "diloco", 1, 0.01, 0): 2.97,
    ("muon", "diloco", 1, 0.02, 0): 2.92,  # best at K = 1
    ("muon", "diloco", 1, 0.04, 0): 2.99,
    ("muon", "diloco", 1, 0.02, 1): 2.93,
    ("muon", "dp", 4, 0.01, 0): 2.95,
    ("muon", "dp", 4, 0.02, 0): 2.90,
    ("muon", "dp", 4, 0.04, 0): 2.80,  # DP's best is the highest lr tried: an edge warning
    ("muon", "dp", 4, 0.04, 1): 2.82,
    ("NAdam", "diloco", 4, 0.001, 0): 3.30,
    ("NAdam", "diloco", 4, 0.001, 1): 3.40,  # mean 3.35
    ("NAdam", "diloco", 4, 0.003, 0): 3.20,
    ("NAdam", "diloco", 4, 0.003, 1): 3.45,  # mean 3.325: best, and the highest tried
    ("NAdam", "dp", 4, 0.001, 0): 3.10,
    ("NAdam", "dp", 4, 0.001, 1): 3.20,  # mean 3.15
    ("NAdam", "dp", 4, 0.003, 0): 3.00,
    ("NAdam", "dp", 4, 0.003, 1): 3.25,  # mean 3.125: best
}
SPEC = TuneSpec(over=("inner.lr",), per=("inner.optimizer", "workers"))


@pytest.fixture
def sweep_dir(tmp_path):
    root = tmp_path / "sweep"
    for (optimizer, method, k, lr, seed), loss in LOSSES.items():
        name = f"{method}_{optimizer}_w{k}_lr{lr}_seed{seed}"
        overrides = [f"inner.optimizer={optimizer}", f"method={method}", f"workers={k}", f"inner.lr={lr}"]
        fake_run(root, name, [*overrides, f"run.seed={seed}"], loss)
    return root


def gap(loss: float, dp: float) -> float:
    return (loss / dp - 1) * 100


def test_the_tuned_report_picks_each_best_and_pairs_the_seeds(sweep_dir):
    outputs = build_report(sweep_dir, SPEC)
    rows = json.loads((sweep_dir / "tuned.json").read_text())["rows"]
    by_cell = {(r["cell"]["settings"]["inner.optimizer"], r["cell"]["settings"]["workers"]): r for r in rows}
    assert list(by_cell) == [("NAdam", 4), ("muon", 1), ("muon", 4)]

    muon4 = by_cell["muon", 4]
    assert muon4["cell"]["best"] == {"inner.lr": 0.02} and muon4["cell"]["chosen_on_seeds"] == [0]
    assert muon4["dp"]["best"] == {"inner.lr": 0.04} and muon4["seeds"] == [0, 1]
    assert muon4["pct_over_dp_per_seed"] == pytest.approx([gap(3.00, 2.80), gap(3.02, 2.82)])
    assert muon4["pct_over_dp"] == pytest.approx(7.117528, abs=1e-6)  # (7.142857 + 7.092199) / 2
    assert (muon4["final_val_loss"], muon4["dp_final_val_loss"]) == pytest.approx((3.01, 2.81))
    assert muon4["cell"]["warnings"] == []
    assert muon4["dp"]["warnings"] == ["inner.lr=0.04 is the highest tried: the optimum may lie above"]

    # No DP run at K = 1: the best DP cell at another K (DP at K = 4, lr 0.04).
    muon1 = by_cell["muon", 1]
    assert muon1["cell"]["best"] == {"inner.lr": 0.02} and muon1["dp"]["settings"]["workers"] == 4
    assert muon1["pct_over_dp"] == pytest.approx((gap(2.92, 2.80) + gap(2.93, 2.82)) / 2)

    # Both seeds at every lr: chosen on their mean (3.325 < 3.35), and flagged at the edge.
    nadam = by_cell["NAdam", 4]
    assert nadam["cell"]["best"] == {"inner.lr": 0.003} and nadam["cell"]["chosen_on_seeds"] == [0, 1]
    assert nadam["dp"]["best"] == {"inner.lr": 0.003}
    assert nadam["pct_over_dp"] == pytest.approx(6.410256, abs=1e-6)  # (6.666667 + 6.153846) / 2
    assert nadam["cell"]["warnings"] == ["inner.lr=0.003 is the highest tried: the optimum may lie above"]

    report = (sweep_dir / "report.md").read_text()
    assert "## Tuned comparison" in report
    assert "| muon | 4 | lr=0.02 | 3.0100 | lr=0.04 | 2.8100 | +7.12% (+7.09..+7.14) | 2 |" in report
    assert "DP: inner.lr=0.04 is the highest tried" in report and "DP at workers=4" in report
    assert "tuned_gap_vs_workers.png" in outputs  # muon at K = 1 and 4: one line with error bars
    assert_png(outputs["tuned_gap_vs_workers.png"])


def test_a_sweep_records_its_tune_for_a_later_report(tmp_path, sweep_dir):
    spec = parse_sweep(
        {"base": str(QUICKSTART), "grid": {"inner.lr": [0.01, 0.02], "workers": [1, 4], "run.seed": [0, 1]},
         "tune": {"over": ["inner.lr"], "per": ["workers"]}},
        tmp_path / "s.yaml",
    )  # fmt: skip
    assert spec.tune == TuneSpec(("inner.lr",), ("workers",))
    (sweep_dir / SWEEP_RECORD).write_text(json.dumps(sweep_record(spec)))
    assert recorded_tune(sweep_dir) == spec.tune
    build_report(sweep_dir)  # no spec given: the recorded one
    rows = json.loads((sweep_dir / "tuned.json").read_text())["rows"]
    # per workers only: inner.optimizer still splits cells (a best is never picked across optimizers)
    assert {(r["cell"]["settings"]["workers"], r["cell"]["settings"]["inner.optimizer"]) for r in rows} == {
        (4, "NAdam"), (1, "muon"), (4, "muon")
    }  # fmt: skip


BAD_TUNES = [
    ({"over": ["inner.lrr"]}, "tune.over key 'inner.lrr' is not in grid"),
    ({"over": ["inner.lr"], "per": ["run.seed"]}, "tune.per lists run.seed"),
    ({"over": ["inner.lr"], "per": ["inner.lr"]}, "inner.lr is both in over and in per"),
    ({"over": []}, "tune.over must name at least one grid key"),
    ({"over": ["inner.lr"], "pre": ["workers"]}, "unknown key tune.pre"),
    (["inner.lr"], "tune must be a mapping"),
]


@pytest.mark.parametrize("tune, message", BAD_TUNES)
def test_a_malformed_tune_is_one_line_naming_it(tmp_path, tune, message):
    sweep = tmp_path / "s.yaml"
    grid = {"inner.lr": [0.01, 0.02], "run.seed": [0, 1]}
    sweep.write_text(json.dumps({"base": str(QUICKSTART), "grid": grid, "tune": tune}))
    done = run_muloco_here("sweep", sweep, "--dry-run")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_report_cli_tune_flags(sweep_dir):
    done = run_muloco_here("report", sweep_dir, "--tune-over", "inner.lr", "--tune-per", "workers")
    assert done.returncode == 0 and (sweep_dir / "tuned.json").exists(), done.stderr
    (sweep_dir / "tuned.json").unlink()
    done = run_muloco_here("report", sweep_dir, "--tune-over", "inner.lrr")
    assert done.returncode == 2 and "tune key 'inner.lrr' is not a config key" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (sweep_dir / "tuned.json").exists()
    done = run_muloco_here("report", sweep_dir, "--tune-per", "workers")
    assert done.returncode == 2 and "--tune-per needs --tune-over" in done.stderr


def test_failed_runs_are_not_candidates_and_a_cell_without_dp_says_so(tmp_path):
    root = tmp_path / "sweep"
    fake_run(root, "a", ["inner.lr=0.01", "workers=2"], 3.0)
    fake_run(root, "b", ["inner.lr=0.02", "workers=2"], 2.0)
    summary = json.loads((root / "b" / "summary.json").read_text())
    (root / "b" / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    build_report(root, TuneSpec(over=("inner.lr",)))
    [row] = json.loads((root / "tuned.json").read_text())["rows"]
    assert row["cell"]["best"] == {"inner.lr": 0.01} and row["cell"]["tried"] == {"inner.lr": [0.01]}
    assert row["dp"] is None and row["pct_over_dp"] is None and row["final_val_loss"] == 3.0
    assert "no DP run with these settings" in (root / "report.md").read_text()


def test_the_builtin_adamw_is_tuned_on_its_own_lr_only(tmp_path):
    """inner.lr does not act on the built-in adamw (it reads inner.adamw.lr): runs that differ only there
    are one candidate, and its seeds pair across them."""
    root = tmp_path / "sweep"
    for name, inner_lr, adamw_lr, seed, loss in [
        ("a0", 0.01, 0.003, 0, 3.0),
        ("a1", 0.02, 0.003, 1, 3.2),  # the same candidate as a0: inner.lr is ignored
        ("b0", 0.01, 0.006, 0, 3.1),
    ]:
        overrides = ["inner.optimizer=adamw", f"inner.lr={inner_lr}", f"inner.adamw.lr={adamw_lr}"]
        fake_run(root, name, [*overrides, f"run.seed={seed}"], loss)
    build_report(root, TuneSpec(over=("inner.lr", "inner.adamw.lr")))
    [row] = json.loads((root / "tuned.json").read_text())["rows"]
    cell = row["cell"]
    assert cell["tried"] == {"inner.lr": [None], "inner.adamw.lr": [0.003, 0.006]}
    assert cell["best"]["inner.adamw.lr"] == 0.003 and cell["chosen_on_seeds"] == [0]
    assert cell["runs"] == {"0": "a0", "1": "a1"}


def test_a_dp_comm_hook_run_is_a_method_tuned_and_compared_against_plain_dp(tmp_path):
    """DDP + PowerSGD is one more method: its own lr, against the uncompressed DP baseline (its sync,
    outer and compression keys ignored as any dp run's), never a baseline itself."""
    root = tmp_path / "sweep"
    for name, hook, lr, outer_lr, loss in [
        ("dp_a", "none", 0.01, 0.7, 3.00),
        ("dp_b", "none", 0.02, 0.7, 2.90),  # the DP baseline
        ("psgd_a", "powersgd", 0.01, 0.7, 3.05),
        ("psgd_a_outer", "powersgd", 0.01, 0.5, 3.06),  # outer.lr acts on no dp run: the same candidate
        ("psgd_b", "powersgd", 0.02, 0.7, 3.10),
    ]:
        overrides = [
            "method=dp",
            "workers=2",
            f"dp.comm_hook={hook}",
            f"inner.lr={lr}",
            f"outer.lr={outer_lr}",
        ]
        fake_run(root, name, overrides, loss)
    build_report(root, TuneSpec(over=("inner.lr", "outer.lr"), per=("dp.comm_hook",)))
    [row] = json.loads((root / "tuned.json").read_text())["rows"]
    # The PowerSGD keys act on this cell only (plain DP runs leave them out): they label it.
    assert row["cell"]["settings"] == {
        "dp.comm_hook": "powersgd",
        "dp.powersgd_rank": 4,
        "dp.powersgd_start_step": 10,
    }
    assert row["cell"]["best"]["inner.lr"] == 0.01 and row["dp"]["best"]["inner.lr"] == 0.02
    assert row["pct_over_dp"] == pytest.approx(gap(3.05, 2.90))
