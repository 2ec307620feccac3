"""muloco/sweep/expand.py: grid/zip/exclude expansion, DP baseline assignments, run names."""

from muloco.sweep.expand import dp_baseline_assignment, expand_grid, run_names


def test_grid_is_the_product_first_key_outermost():
    runs = expand_grid({"inner.optimizer": ["adamw", "muon"], "workers": [1, 4]})
    assert runs == [
        {"inner.optimizer": "adamw", "workers": 1},
        {"inner.optimizer": "adamw", "workers": 4},
        {"inner.optimizer": "muon", "workers": 1},
        {"inner.optimizer": "muon", "workers": 4},
    ]
    assert expand_grid({}) == [{}]


def test_zip_advances_keys_together_and_exclude_drops_matching_runs():
    grid = {"sync.every": [15, 30, 60], "inner.optimizer": ["adamw", "muon"], "outer.lr": [0.5, 0.7, 0.9]}
    runs = expand_grid(grid, [["sync.every", "outer.lr"]])
    assert [(r["sync.every"], r["outer.lr"]) for r in runs[::2]] == [(15, 0.5), (30, 0.7), (60, 0.9)]
    assert len(runs) == 6 and list(runs[0]) == list(grid)  # keys stay in grid order
    kept = expand_grid(grid, [["sync.every", "outer.lr"]], [{"sync.every": 60, "inner.optimizer": "muon"}])
    assert len(kept) == 5 and {"sync.every": 60, "inner.optimizer": "muon", "outer.lr": 0.9} not in kept


def test_dp_baseline_keeps_optimizer_and_workers_and_drops_what_dp_ignores():
    run = {"inner.optimizer": "muon", "workers": 4, "sync.every": 30, "compression.bits": 2, "outer.lr": 0.5}
    assert dp_baseline_assignment(run) == {"method": "dp", "inner.optimizer": "muon", "workers": 4}
    # A dp.comm_hook run's baseline is plain DP: uncompressed gradients.
    hooked = {"method": "dp", "dp.comm_hook": "powersgd", "dp.powersgd_rank": 4, "workers": 4}
    assert dp_baseline_assignment(hooked) == {"method": "dp", "workers": 4}


# --- names --------------------------------------------------------------------------------------------


def test_run_names_are_readable_unique_deterministic_and_safe():
    runs = expand_grid({"inner.optimizer": ["adamw", "muon"], "workers": [1, 4], "run.seed": [0]})
    assert run_names(runs) == ["adamw_w1", "adamw_w4", "muon_w1", "muon_w4"]  # constant keys left out
    odd = [{"data.path": "a/b c"}, {"data.path": "a_b?c"}, {"data.path": "a b/c"}]
    names = run_names(odd)
    assert names == run_names(odd) and len(set(names)) == 3
    assert all(n.replace("_", "").replace("-", "").replace(".", "").isalnum() for n in names), names
    both = run_names([{"inner.lr": 0.01, "outer.lr": 0.7}, {"inner.lr": 0.02, "outer.lr": 0.5}])
    assert both == ["inner.lr-0.01_outer.lr-0.7", "inner.lr-0.02_outer.lr-0.5"]


def test_fp32_runs_leave_out_bits_and_error_feedback():
    runs = [
        {"compression.scheme": "none", "compression.bits": 8, "compression.error_feedback": False},
        {"compression.scheme": "statistical", "compression.bits": 2, "compression.error_feedback": True},
    ]
    assert run_names(runs) == ["fp32", "statistical_2bit_ef"]


def test_dp_comm_hook_runs_are_named_for_their_hook_and_rank():
    runs = [
        {"dp.comm_hook": "none", "dp.powersgd_rank": 1},
        {"dp.comm_hook": "bf16", "dp.powersgd_rank": 1},
        {"dp.comm_hook": "powersgd", "dp.powersgd_rank": 4},
    ]
    assert run_names(runs) == ["ddp", "ddp-bf16", "ddp-powersgd_r4"]  # the rank only where PowerSGD runs
