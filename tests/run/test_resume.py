"""What the ranks agree on at start (resume.py): the same config, and the newest checkpoint every rank holds
and can read. A fake world of two ranks stands in for torch.distributed (the real one: test_torch_dist.py)."""

import json

import pytest

from muloco.checkpoint.plain import save_checkpoint
from muloco.comm import CompletedHandle, LocalBackend
from muloco.errors import CheckpointError, UserError
from muloco.run.resume import check_same_config, find_resume_checkpoint


class TwoRanks:
    """Rank 0 of two; the other rank answers every all-gather with `other(payload)`."""

    rank, world_size = 0, 2

    def __init__(self, other):
        self.other = other

    def all_gather_bytes(self, payload: bytes, capacity: int | None = None):
        return CompletedHandle([payload, self.other(payload)])

    def barrier(self):
        pass


def checkpoint(directory, step, fingerprint="f", indices=(0,)):
    state = {"fingerprint": fingerprint, "local_indices": list(indices), "progress": {"steps": step}}
    return save_checkpoint(state, directory, step, keep=10)


def test_ranks_with_different_configs_all_stop():
    check_same_config(LocalBackend(), "a")  # one process: nothing to agree on
    check_same_config(TwoRanks(lambda mine: mine), "a")
    with pytest.raises(UserError, match="the config differs across ranks"):
        check_same_config(TwoRanks(lambda mine: b"b"), "a")


def test_the_newest_step_every_rank_holds_is_taken(tmp_path):
    for step in (3, 6, 9):
        checkpoint(tmp_path, step)

    def other(payload):  # the other rank was killed before writing step 9
        return json.dumps([3, 6]).encode() if payload.startswith(b"[") else payload

    path, state = find_resume_checkpoint(TwoRanks(other), "auto", tmp_path, "f", [0])
    assert path.name == "step_00000006.pt" and state["progress"]["steps"] == 6


def test_ranks_resuming_from_different_steps_stop(tmp_path):
    path = checkpoint(tmp_path, 3)

    def other(payload):  # a step number: the other rank was given another checkpoint
        return b"6" if payload.isdigit() else payload

    with pytest.raises(CheckpointError, match=r"different steps to resume from \(\[3, 6\]\)"):
        find_resume_checkpoint(TwoRanks(other), str(path), tmp_path, "f", [0])


def test_a_checkpoint_of_another_config_or_other_replicas_is_refused(tmp_path):
    checkpoint(tmp_path, 3, fingerprint="other")
    with pytest.raises(CheckpointError, match="different config"):
        find_resume_checkpoint(LocalBackend(), "auto", tmp_path, "f", [0])
    checkpoint(tmp_path, 6, indices=(1,))
    with pytest.raises(CheckpointError, match=r"holds replicas \[1\], not \[0\]"):
        find_resume_checkpoint(LocalBackend(), "auto", tmp_path, "f", [0])
    assert find_resume_checkpoint(LocalBackend(), "never", tmp_path, "f", [0]) is None
