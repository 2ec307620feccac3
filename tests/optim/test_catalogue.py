"""Any optimizer as the inner optimizer (issue 38): a torch.optim class, a pytorch-optimizer name or a
user's module:Class trains, routes, follows the lr schedule and resumes bit for bit; what the inner loop
cannot give it is one line and exit 2 with nothing written."""

import shutil
import sys

import pytest
import torch
from test_helpers import run_muloco_here

from muloco.checkpoint.plain import list_checkpoints
from muloco.config import load_config
from muloco.errors import ConfigError
from muloco.optim import build_inner_optimizer
from muloco.optim.catalogue import check_kwargs, optimizer_class
from muloco.run.trainer import Trainer

CUSTOM = "custom_optimizer:SignDescent"  # tests/custom_optimizer.py


def run(overrides):
    trainer = Trainer(load_config(None, overrides))
    return trainer, trainer.run()


def final_params(trainer):
    return [p.detach().clone() for p in trainer.replicas[0].model.parameters()]


def test_names_resolve_to_torch_catalogue_and_user_classes():
    import pytorch_optimizer

    assert optimizer_class("NAdam") is torch.optim.NAdam
    assert optimizer_class("Adafactor") is torch.optim.Adafactor
    assert optimizer_class("lion") is pytorch_optimizer.Lion
    assert optimizer_class("soap") is pytorch_optimizer.SOAP
    assert optimizer_class(CUSTOM).__name__ == "SignDescent"


def test_kwargs_are_checked_against_the_constructor_even_behind_a_catch_all():
    lion = optimizer_class("lion")  # Lion(params, lr, betas, ..., **kwargs): extras would be dropped silently
    check_kwargs("lion", lion, {"betas": (0.9, 0.99), "weight_decay": 0.1})
    with pytest.raises(
        ValueError, match=r"inner.kwargs.beta is not an argument of Lion \(lion\); it takes: betas"
    ):
        check_kwargs("lion", lion, {"beta": 0.9})
    with pytest.raises(ValueError, match="inner.kwargs.lr is set by muloco for lion: set inner.lr"):
        check_kwargs("lion", lion, {"lr": 0.1})


def test_the_routing_puts_all_or_only_the_matrices_on_it(tiny):
    from muloco.models import build_model

    cfg = load_config(None, [*tiny, "inner.optimizer=NAdam"])
    model = build_model(cfg.model, 256)
    every = build_inner_optimizer(model, cfg.inner)
    assert [type(o) for o in every.optimizers] == [torch.optim.NAdam]
    assert every.describe().splitlines()[1].split()[:2] == ["NAdam", "16"]  # embeddings, norms, head too
    cfg = load_config(
        None, [*tiny, "inner.optimizer=NAdam", "inner.route=matrices", "inner.kwargs={momentum_decay: 0.005}"]
    )
    split = build_inner_optimizer(model, cfg.inner)
    assert [type(o) for o in split.optimizers] == [torch.optim.NAdam, torch.optim.AdamW]
    rows = [line.split() for line in split.describe().splitlines()[1:]]
    assert [row[:2] for row in rows] == [["NAdam", "8"], ["adamw", "8"]] and rows[0][-1] == "x8"
    nadam = split.optimizers[0].param_groups[0]
    assert nadam["lr"] == cfg.inner.lr and nadam["momentum_decay"] == 0.005 and nadam["name"] == "NAdam"


# madgrad keeps a bare tensor beside its per-parameter dicts in `optimizer.state`.
@pytest.mark.parametrize("name", ["lion", "adopt", "ademamix", "madgrad", CUSTOM])
def test_it_trains_and_resumes_bitwise(tiny, tmp_path, name):
    """Inner state is kept across syncs, so its state_dict must be in the checkpoints for the resume to be
    exact; the lr schedule (warmup, then cosine) reaches its group as it reaches Muon's."""
    overrides = [*tiny, f"inner.optimizer={name}", "inner.lr=0.003", "workers=2", "checkpoint.every=1"]
    overrides += ["checkpoint.keep=10"]
    full, summary = run(overrides)
    assert summary["status"] == "completed" and summary["inner_optimizer"] == name
    assert summary["final_val_loss"] < 5.4  # from ~5.55 (ln 256) at init: it learned
    optimizer = full.replicas[0].optimizer.optimizers[0]
    assert optimizer.state, "the optimizer kept no state: the resume would check nothing"
    assert optimizer.param_groups[0]["initial_lr"] == 0.003
    assert 0 <= optimizer.param_groups[0]["lr"] < 0.003  # the schedule scaled it (cosine decay at the end)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.run_dir, resumed_dir / full.cfg.run.name)
    for path in list_checkpoints(resumed_dir / full.cfg.run.name / "checkpoints")[1:]:
        path.unlink()
    resumed, _ = run([*overrides, f"run.output_dir={resumed_dir}"])
    assert resumed.resumed_from is not None
    for a, b in zip(final_params(full), final_params(resumed), strict=True):
        assert torch.equal(a, b)


BAD = [
    (["inner.optimizer=lino"], "inner.optimizer: unknown optimizer 'lino'; did you mean lion?"),
    (["inner.optimizer=custom_optimizer:NotAnOptimizer"], "is not a torch.optim.Optimizer subclass"),
    (["inner.optimizer=no_such_module:Opt"], "cannot import module 'no_such_module'"),
    (
        ["inner.optimizer=lion", "inner.kwargs={betaz: [0.9, 0.99]}"],
        "inner.kwargs.betaz is not an argument of Lion",
    ),
    (["inner.optimizer=LBFGS"], "LBFGS needs a closure"),
    (["inner.optimizer=adahessian"], "needs second-order information"),
    (["inner.optimizer=schedulefreeadamw"], "keeps separate train and eval weights"),
    (["inner.optimizer=a2grad"], "a2grad keeps no lr in its param groups"),
    # A deque in its state: it would train, then fail at its first resume (checkpoints load weights_only).
    (["inner.optimizer=adashift"], "adashift keeps collections.deque objects in its state"),
    (["inner.optimizer=muon", "inner.route=all"], "inner.route=all puts every parameter on muon"),
    (
        ["inner.optimizer=adamw", "inner.kwargs={amsgrad: true}"],
        "inner.kwargs is for optimizers that are not built in",
    ),
    (["inner.optimizer=Muon"], "Muon cannot step a matrix and a vector"),  # torch.optim.Muon: 2-D only
    (
        ["inner.optimizer=lion", "sharding=fsdp", "backend.kind=torch"],
        "sharding=fsdp does not run with inner.optimizer=lion",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[m[:28] for _, m in BAD])
def test_bad_optimizer_settings_are_one_line_and_exit_2_with_nothing_written(
    tiny, tmp_path, overrides, message
):
    done = run_muloco_here("train", "configs/quickstart.yaml", *tiny, *overrides)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("muloco: error:") and message in last[0], done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_catalogue_name_without_the_extra_says_which_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # as if not installed: its import fails
    optimizer_class.cache_clear()  # names this process resolved with the extra installed
    try:
        with pytest.raises(ValueError, match=r"pip install 'muloco\[optimizers\]'"):
            optimizer_class("lion")
        assert optimizer_class("NAdam") is torch.optim.NAdam  # torch's own need no extra
    finally:
        optimizer_class.cache_clear()  # nothing resolved without the extra outlives the test


def test_a_constructor_that_refuses_a_real_parameter_is_a_config_error(tiny):
    """What the config's trial step cannot see (a shape only the model has) still ends in one line."""
    from muloco.models import build_model

    cfg = load_config(None, [*tiny, "inner.optimizer=Muon", "inner.route=matrices"])
    model = build_model(cfg.model, 256)
    model.register_parameter("cube", torch.nn.Parameter(torch.zeros(2, 2, 2)))
    with pytest.raises(ConfigError, match="inner.optimizer=Muon refused its parameters"):
        build_inner_optimizer(model, cfg.inner, process_group=None)


def test_offload_moves_state_kept_in_lists(tiny):
    """simulation.offload moves a replica's optimizer state with `Replica.map_tensors`: tensors kept in
    lists (SOAP's eigenbases, one per dimension) move too, not only the state's top-level tensors."""
    from muloco.run.replica import Replica

    trainer = Trainer(
        load_config(None, [*tiny, "inner.optimizer=soap", "workers=1", "train.total_tokens=512"])
    )
    trainer.run()
    replica: Replica = trainer.replicas[0]
    nested = [
        t
        for state in replica.optimizer.optimizers[0].state.values()
        for value in state.values()
        if isinstance(value, list)
        for t in value
        if torch.is_tensor(t) and t.dim() > 0
    ]
    assert nested, "SOAP kept no list of tensors: the test would check nothing"
    moved = []
    replica.map_tensors(lambda t: moved.append(t) or t.clone())
    assert {id(t) for t in nested} <= {id(t) for t in moved}
