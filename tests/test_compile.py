"""model.compile: torch.compile for every replica; the same losses as eager, one graph for all replicas
and rounds (plus one for the no-grad evals)."""

import pytest
import torch
from torch._dynamo.utils import counters

from muloco.config import load_config
from muloco.run.build import cpu_compiler
from muloco.run.trainer import Trainer

pytestmark = [
    pytest.mark.slow(seconds=60),  # inductor compiles C++: 40-65 s on 2 cores
    pytest.mark.skipif(cpu_compiler() is None, reason="torch.compile on the CPU needs a C++ compiler"),
]


def test_compiled_replicas_match_eager_and_share_one_graph(tiny):
    # K = 2 replicas, 3 rounds (H = 3), an eval every 4 steps.
    args = [*tiny, "workers=2", "train.batch_tokens=512", "train.total_tokens=4608"]
    eager = Trainer(load_config(None, [*args, "run.name=eager"])).run()
    torch._dynamo.reset()
    counters.clear()
    compiled_trainer = Trainer(load_config(None, [*args, "run.name=compiled", "model.compile=true"]))
    compiled = compiled_trainer.run()
    assert compiled["outer_steps"] == eager["outer_steps"] == 3
    # One graph for training (grad mode) and one for the evals (no_grad): not one per replica or round.
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert compiled["final_val_loss"] == pytest.approx(eager["final_val_loss"], rel=1e-4)
    assert compiled["initial_val_loss"] == pytest.approx(eager["initial_val_loss"], rel=1e-5)
    # Parameter names are unchanged (nn.Module.compile), so checkpoints of either resume in the other.
    names = [n for n, _ in compiled_trainer.replicas[0].model.named_parameters()]
    assert not any("_orig_mod" in n for n in names)
