"""Reliability (docs/reliability.md): bad input never hurts an earlier run, interrupts stop after the
current inner step and resume exactly, non-finite replicas are left out and the run stops after
train.max_bad_syncs in a row."""

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from interrupts import interrupted_and_resumed
from test_helpers import hand_inner_steps, params_of

from muloco.checkpoint.plain import list_checkpoints, load_checkpoint
from muloco.cli import main
from muloco.comm import CompletedHandle
from muloco.config import load_config
from muloco.errors import TrainingError
from muloco.run.signals import StopRequest
from muloco.run.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
QS = str(ROOT / "configs/quickstart.yaml")


# -- the bad-input suite ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def earlier(tmp_path_factory, TINY_module):
    """A finished run whose files no bad command may touch."""
    out = tmp_path_factory.mktemp("earlier")
    assert main(["train", QS, *TINY_module, f"run.output_dir={out}", "run.name=earlier"]) == 0
    return out


@pytest.fixture(scope="module")
def TINY_module():
    from conftest import TINY

    return list(TINY)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file's digest and every directory (a new empty run directory shows too)."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# (name, command line after `muloco`, files to create first {name: content}, a word the message must hold)
# `{QS}`, `{RUN}` (the earlier run's overrides) and `{TMP}` are filled in by the test.
BAD_INPUTS = [
    ("missing config", ["train", "{TMP}/missing.yaml", "{RUN}"], {}, "config file not found"),
    ("yaml syntax", ["train", "{TMP}/bad.yaml", "{RUN}"], {"bad.yaml": "run: {name: [x\n"}, "YAML syntax"),
    ("yaml not a mapping", ["train", "{TMP}/list.yaml", "{RUN}"], {"list.yaml": "- a\n- b\n"}, "mapping"),
    (
        "extends missing",
        ["train", "{TMP}/ext.yaml", "{RUN}"],
        {"ext.yaml": "extends: nope.yaml\n"},
        "nope.yaml",
    ),
    ("unknown section", ["train", "{QS}", "{RUN}", "trian.total_tokens=5"], {}, "did you mean 'train'"),
    ("unknown key", ["train", "{QS}", "{RUN}", "inner.lrr=0.1"], {}, "inner.lrr"),
    ("override without =", ["train", "{QS}", "{RUN}", "workers"], {}, "workers"),
    ("wrong type", ["train", "{QS}", "{RUN}", "workers=abc"], {}, "workers"),
    ("zero workers", ["train", "{QS}", "{RUN}", "workers=0"], {}, "workers"),
    ("negative lr", ["train", "{QS}", "{RUN}", "inner.lr=-1"], {}, "inner.lr"),
    ("unknown optimizer", ["train", "{QS}", "{RUN}", "inner.optimizer=lino"], {}, "inner.optimizer"),
    ("batch not divisible", ["train", "{QS}", "{RUN}", "workers=3"], {}, "train.batch_tokens"),
    (
        "micro batch",
        ["train", "{QS}", "{RUN}", "train.micro_batch_tokens=48"],
        {},
        "train.micro_batch_tokens",
    ),
    ("budget below a step", ["train", "{QS}", "{RUN}", "train.total_tokens=10"], {}, "train.total_tokens"),
    (
        "dp + compression",
        ["train", "{QS}", "{RUN}", "method=dp", "compression.scheme=statistical"],
        {},
        "compression",
    ),
    ("dp + streaming", ["train", "{QS}", "{RUN}", "method=dp", "sync.fragments=2"], {}, "sync.fragments"),
    ("fragments > H", ["train", "{QS}", "{RUN}", "sync.fragments=4"], {}, "sync.fragments"),
    (
        "overlap too long",
        ["train", "{QS}", "{RUN}", "sync.every=6", "sync.fragments=2", "sync.overlap=4"],
        {},
        "sync.overlap",
    ),
    (
        "fragments > blocks",
        ["train", "{QS}", "{RUN}", "sync.every=6", "sync.fragments=3"],
        {},
        "sync.fragments",
    ),
    (
        "bits",
        ["train", "{QS}", "{RUN}", "compression.scheme=linear", "compression.bits=3"],
        {},
        "compression.bits",
    ),
    ("heads", ["train", "{QS}", "{RUN}", "model.d_model=30", "model.n_heads=4"], {}, "model.d_model"),
    ("preset", ["train", "{QS}", "{RUN}", "model.preset=huge"], {}, "model.preset"),
    (
        "text path",
        ["train", "{QS}", "{RUN}", "data.source=text", "data.path=/nonexistent/c.txt"],
        {},
        "data.path",
    ),
    (
        "tokens path",
        ["train", "{QS}", "{RUN}", "data.source=tokens", "data.path=/nonexistent", "data.vocab_size=9"],
        {},
        "data.path",
    ),
    (
        "empty text",
        ["train", "{QS}", "{RUN}", "data.source=text", "data.path={TMP}/e.txt"],
        {"e.txt": ""},
        "data.path",
    ),
    (
        "unwritable output",
        ["train", "{QS}", "{TINY}", "run.output_dir=/proc/version/x"],
        {},
        "run.output_dir",
    ),
    ("no cuda", ["train", "{QS}", "{RUN}", "device=cuda"], {}, "device"),
    (
        "ranks without processes",
        ["train", "{QS}", "{RUN}", "ranks_per_worker=2", "train.micro_batch_tokens=32"],
        {},
        "ranks_per_worker",
    ),
    (
        "ranks with dp",
        ["train", "{QS}", "{RUN}", "method=dp", "ranks_per_worker=2", "train.micro_batch_tokens=32"],
        {},
        "ranks_per_worker",
    ),
    (
        "hivemind with dp",
        ["train", "{QS}", "{RUN}", "method=dp", "backend.kind=hivemind"],
        {},
        "backend.kind",
    ),
    (
        "hivemind peer index",
        ["train", "{QS}", "{RUN}", "backend.kind=hivemind", "backend.hivemind.peer_index=5"],
        {},
        "backend.hivemind.peer_index",
    ),
    (
        "hivemind run id",
        ["train", "{QS}", "{RUN}", "backend.kind=hivemind", "backend.hivemind.run_id=a b"],
        {},
        "backend.hivemind.run_id",
    ),
    (
        "resume file missing",
        ["train", "{QS}", "{RUN}", "checkpoint.resume={TMP}/no.pt"],
        {},
        "checkpoint.resume",
    ),
    (
        "resume file corrupt",
        ["train", "{QS}", "{RUN}", "checkpoint.resume={TMP}/bad.pt"],
        {"bad.pt": b"\x00junk"},
        "bad.pt",
    ),
    ("resume other config", ["train", "{QS}", "{RUN}", "inner.lr=0.03"], {}, "different config"),
    ("progress mode", ["train", "{QS}", "{RUN}", "logging.progress=fancy"], {}, "logging.progress"),
    ("plan params", ["plan", "--params", "lots"], {}, "--params"),
    ("sweep missing", ["sweep", "{TMP}/nosweep.yaml"], {}, "nosweep.yaml"),
]


@pytest.mark.parametrize("name, argv, files, needle", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_exits_2_names_the_field_and_leaves_earlier_runs_alone(
    name, argv, files, needle, earlier, TINY_module, tmp_path, capsys
):
    for filename, content in files.items():
        write(tmp_path / filename, content)
    run = [*TINY_module, f"run.output_dir={earlier}", "run.name=earlier"]
    args = []
    for a in argv:
        if a == "{RUN}":
            args += run
        elif a == "{TINY}":
            args += TINY_module
        else:
            args.append(a.replace("{QS}", QS).replace("{TMP}", str(tmp_path)))
    before = snapshot(earlier)
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("muloco: error:")]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err
    assert snapshot(earlier) == before  # no file of the earlier run was touched


def test_bad_data_leaves_no_run_directory_behind(TINY_module, tmp_path, capsys):
    """The run directory is made once the config and the data are known to be good."""
    runs = tmp_path / "runs"
    args = [
        "train",
        QS,
        *TINY_module,
        f"run.output_dir={runs}",
        "data.source=text",
        "data.path=/nonexistent/c",
    ]
    assert main(args) == 2
    assert "data.path" in capsys.readouterr().err and not runs.exists()


def test_the_bad_input_suite_is_large_enough():
    assert len(BAD_INPUTS) >= 25


def test_all_corrupt_checkpoints_are_an_error_not_a_fresh_start(earlier, TINY_module, tmp_path, capsys):
    shutil.copytree(earlier / "earlier", tmp_path / "copy")
    for path in list_checkpoints(tmp_path / "copy" / "checkpoints"):
        path.write_bytes(path.read_bytes()[:100])  # truncated
    assert main(["train", QS, *TINY_module, f"run.output_dir={tmp_path}", "run.name=copy"]) == 2
    assert "is corrupt" in capsys.readouterr().err


# -- interrupts -------------------------------------------------------------------------------------------


# Replicas one after another (the order these tests describe); batched replicas: test_batched.py and the
# batched case of test_a_non_finite_replica_is_left_out_and_reset.
INTERRUPTIBLE = [
    "workers=3",
    "train.batch_tokens=384",
    "train.total_tokens=4608",
    "sync.every=6",
    "simulation.batched=false",
]


def test_a_signal_stops_after_the_current_inner_step_and_resume_is_exact(tiny):
    """SIGINT in the middle of replica 1's round: it finishes that one inner step, replica 2 does not
    start, the checkpoint holds each replica's own step, and the resumed run equals the uninterrupted one."""
    overrides = [*tiny, *INTERRUPTIBLE, "inner.optimizer=adamw"]
    state, _ = interrupted_and_resumed(overrides, replica=1, after_step=7)  # the second round's second step
    assert [r["inner_steps"] for r in state["replicas"]] == [12, 8, 6] and state["progress"]["steps"] == 6


# -- non-finite guards ----------------------------------------------------------------------------------


def poison(trainer: Trainer, replica_index: int, at_steps: set[int]) -> None:
    """Make one replica's parameters NaN after the given inner steps (a diverging worker)."""
    replica = trainer.replicas[replica_index]
    original = replica.compute_gradients  # called by train_step and by batched replicas alike

    def step(*args, **kwargs):
        loss = original(*args, **kwargs)
        if replica.inner_steps + 1 in at_steps:
            with torch.no_grad():
                next(replica.model.parameters()).fill_(float("nan"))
        return loss

    replica.compute_gradients = step


@pytest.mark.parametrize("batched", ["false", "true"])
def test_a_non_finite_replica_is_left_out_and_reset(tiny, batched):
    overrides = [*tiny, *INTERRUPTIBLE, f"simulation.batched={batched}"]
    trainer = Trainer(load_config(None, overrides))
    assert trainer.batched == (batched == "true")
    poison(trainer, 1, {5})
    summary = trainer.run()
    assert summary["status"] == "completed"
    records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    assert [r["replicas_left_out"] for r in syncs] == [1, 0]
    assert all(torch.isfinite(p).all() for p in trainer.engine.outer.params)
    for p, g in zip(params_of(trainer.replicas[1].model), trainer.engine.outer.params, strict=True):
        assert torch.equal(p, g)  # reset, then merged like the others


def test_the_first_sync_averages_the_healthy_replicas_only(tiny):
    """Replica 1 diverges: the outer step uses the mean of replicas 0 and 2's pseudogradients (DiLoCo's
    first Nesterov step: theta - lr (1 + m) mean delta), computed here from hand-trained workers."""
    cfg = load_config(None, [*tiny, *INTERRUPTIBLE, "train.total_tokens=2304", "inner.optimizer=adamw"])
    trainer = Trainer(cfg)
    theta = [p.clone() for p in trainer.engine.outer.params]
    poison(trainer, 1, {5})
    trainer.run()
    workers = [hand_inner_steps(cfg, trainer, r, 6) for r in (0, 2)]
    for i, t in enumerate(theta):
        mean_delta = ((t - workers[0][i]) + (t - workers[1][i])) / 2
        expected = t - cfg.outer.lr * (1 + cfg.outer.momentum) * mean_delta
        torch.testing.assert_close(trainer.engine.outer.params[i], expected, rtol=0, atol=1e-6)


def test_max_bad_syncs_in_a_row_stop_the_run_and_keep_the_checkpoint(tiny, capsys):
    overrides = [*tiny, *INTERRUPTIBLE, "train.max_bad_syncs=2", "checkpoint.every=1", "checkpoint.keep=10"]
    trainer = Trainer(load_config(None, overrides))
    poison(trainer, 0, {3, 9})
    with pytest.raises(TrainingError, match="train.max_bad_syncs = 2"):
        trainer.run()
    summary = json.loads((trainer.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    checkpoints = list_checkpoints(trainer.checkpoint_dir)
    assert [p.name for p in checkpoints] == [
        "step_00000006.pt"
    ]  # after the first bad sync, before the second
    assert all(torch.isfinite(p).all() for p in load_checkpoint(checkpoints[-1])["engine"]["outer"]["params"])


def test_diverged_run_exits_1_with_one_line(tiny, capsys, monkeypatch):
    import muloco.run.replica

    def nan_loss(self, *args, **kwargs):
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("nan"))
        return float("nan")

    monkeypatch.setattr(muloco.run.replica.Replica, "train_step", nan_loss)
    assert main(["train", QS, *tiny, *INTERRUPTIBLE, "train.max_bad_syncs=1"]) == 1
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("muloco: error:")]
    assert len(errors) == 1 and "diverged" in errors[0]


def test_dp_skips_non_finite_steps(tiny):
    trainer = Trainer(load_config(None, [*tiny, "method=dp", "train.max_bad_syncs=5"]))
    model = trainer.replicas[0].model
    backward_calls = []

    def nan_on_third_backward(grad):
        backward_calls.append(1)
        return torch.full_like(grad, float("nan")) if len(backward_calls) == 3 else grad

    hook = next(model.parameters()).register_hook(nan_on_third_backward)
    before_third = {}
    original = trainer.dp.step

    def dp_step(*args):
        if trainer.progress.steps == 2:
            before_third.update(params=params_of(model))
        result = original(*args)
        if trainer.progress.steps == 3:  # the non-finite step left the parameters as they were
            assert all(
                torch.equal(a, b) for a, b in zip(before_third["params"], params_of(model), strict=True)
            )
        return result

    trainer.dp.step = dp_step
    summary = trainer.run()
    hook.remove()
    assert summary["status"] == "completed" and trainer.progress.bad_syncs == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


class TwoRanks:
    """A backend of two processes whose other rank sets its flag when told: the all-reduce's sum is
    known when it starts, but (as over a slow link) read only when waited for; each start is counted."""

    rank, world_size = 0, 2

    def __init__(self):
        self.other_flag, self.started = 0.0, 0

    def all_reduce_sum(self, tensors):
        self.started += 1
        return CompletedHandle([tensors[0] + self.other_flag])


def test_ranks_agree_to_stop_a_round_after_a_signal_with_one_collective_per_round():
    backend = TwoRanks()
    stop = StopRequest(backend)
    assert not stop.agreed()  # round 1: nothing started before it
    backend.other_flag = float(signal.SIGTERM)  # the other rank is told to stop during round 2
    assert not stop.agreed()  # round 2 reads round 1's flags
    assert stop.agreed() and stop.signal == signal.SIGTERM  # round 3 reads round 2's: both stop here
    assert backend.started == 3
    # After the last round: the pending flags and a blocking look at this round's.
    backend.other_flag = 0.0
    assert stop.settle() and backend.started == 4


def test_a_signal_during_the_last_round_is_seen_by_settle():
    backend = TwoRanks()
    stop = StopRequest(backend)
    assert not stop.agreed() and not stop.agreed()
    backend.other_flag = float(signal.SIGINT)
    assert stop.settle() and stop.signal == signal.SIGTERM


def test_a_second_ctrl_c_leaves_at_once_keeping_the_last_checkpoint(tiny):
    overrides = [*tiny, *INTERRUPTIBLE, "checkpoint.every=1"]
    trainer = Trainer(load_config(None, overrides))
    replica = trainer.replicas[0]
    original_step = replica.train_step

    def step_then_two_signals(*args, **kwargs):
        loss = original_step(*args, **kwargs)
        if replica.inner_steps == 8:
            signal.raise_signal(signal.SIGINT)  # the first asks for a checkpoint after this step ...
            signal.raise_signal(signal.SIGINT)  # ... the second leaves at once
        return loss

    replica.train_step = step_then_two_signals
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert json.loads((trainer.run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert [p.name for p in list_checkpoints(trainer.checkpoint_dir)] == ["step_00000006.pt"]
    assert signal.getsignal(signal.SIGINT) is before  # the caller's handler is back


# -- checkpoint files -----------------------------------------------------------------------------------


def test_a_failed_write_leaves_the_earlier_checkpoints_and_no_temporary_file(tmp_path, monkeypatch):
    from muloco.checkpoint import plain as checkpoint

    checkpoint.save_checkpoint({"step": 1}, tmp_path, 1, keep=5)
    before = snapshot(tmp_path)

    def torn_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint({"step": 2}, tmp_path, 2, keep=5)
    assert snapshot(tmp_path) == before  # step 1 intact, no step 2, no temporary file left


def test_only_the_newest_keep_checkpoints_remain(tmp_path):
    from muloco.checkpoint.plain import save_checkpoint

    for step in range(1, 6):
        save_checkpoint({"step": step}, tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000005.pt"]


class _NotATensor:
    pass


def test_checkpoints_load_with_weights_only(tmp_path):
    """A checkpoint that would need arbitrary unpickling (code execution) is refused."""
    from muloco.checkpoint.plain import FORMAT_VERSION
    from muloco.errors import CheckpointError

    path = tmp_path / "step_00000001.pt"
    torch.save({"format": FORMAT_VERSION, "payload": _NotATensor()}, path)
    with pytest.raises(CheckpointError, match="corrupt or not a muloco checkpoint"):
        load_checkpoint(path)
