"""The run records a report reads (muloco/tools/runs.py): each run's acting settings and its DP baseline."""

from tools.test_report import fake_run

from muloco.tools.runs import acting_settings, find_baseline, load_runs


def test_baseline_needs_the_same_optimizer_tokens_and_settings(tmp_path):
    fake_run(tmp_path, "dp_adamw", ["method=dp", "inner.optimizer=adamw"], 2.0)
    fake_run(tmp_path, "dp_muon_short", ["method=dp", "inner.optimizer=muon"], 2.0, tokens=300_000)
    fake_run(tmp_path, "dp_muon_lr", ["method=dp", "inner.optimizer=muon", "inner.lr=0.04"], 2.0)
    fake_run(tmp_path, "muon", ["inner.optimizer=muon"], 2.1)
    fake_run(tmp_path, "adamw", ["inner.optimizer=adamw", "sync.every=60"], 2.1)
    runs = {r.name: r for r in load_runs(tmp_path)}
    assert find_baseline(runs["adamw"], list(runs.values())).name == "dp_adamw"
    # No DP run at Muon's lr: the tuned baseline, the best DP run that differs only in its lrs.
    assert find_baseline(runs["muon"], list(runs.values())).name == "dp_muon_lr"
    fake_run(tmp_path, "dp_muon_lr_best", ["method=dp", "inner.optimizer=muon", "inner.lr=0.03"], 1.9)
    runs = {r.name: r for r in load_runs(tmp_path)}
    assert find_baseline(runs["muon"], list(runs.values())).name == "dp_muon_lr_best"
    fake_run(tmp_path, "dp_muon", ["method=dp", "inner.optimizer=muon"], 2.05)  # the same lr wins
    runs = {r.name: r for r in load_runs(tmp_path)}
    assert find_baseline(runs["muon"], list(runs.values())).name == "dp_muon"


def test_keys_that_do_not_act_on_a_run_are_left_out_of_its_settings():
    """A run written before train.decay_fraction or dp.* existed compares equal to one carrying their
    defaults: the keys count only where they act."""
    old = {"inner.lr": 0.02, "train.lr_schedule": "cosine"}
    new = {**old, "train.decay_fraction": 0.2, "dp.comm_hook": "none", "dp.powersgd_rank": 4}
    assert acting_settings(new) == acting_settings(old) == old
    bf16 = {**new, "dp.comm_hook": "bf16"}
    assert acting_settings(bf16) == {**old, "dp.comm_hook": "bf16"}
    wsd = {**new, "train.lr_schedule": "wsd"}
    assert acting_settings(wsd)["train.decay_fraction"] == 0.2
