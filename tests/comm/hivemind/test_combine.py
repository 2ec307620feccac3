"""The group's combine rule (muloco/comm/hivemind/combine.py): which contributions count, and the mean."""

import math
import pickle

import pytest
import torch

pytest.importorskip("hivemind")

from muloco.comm.hivemind import AverageResult, contribution_problem, norm_outliers, wrap_payload  # noqa: E402
from muloco.comm.hivemind.auth import SwarmAuth  # noqa: E402
from muloco.comm.hivemind.combine import _metadata_problem, withheld  # noqa: E402
from muloco.comm.hivemind.exclusion import Exclusion, exclusion_kind  # noqa: E402
from muloco.comm.hivemind.payloads import payload_token  # noqa: E402
from muloco.comm.hivemind.transfer import checked_download  # noqa: E402
from muloco.compress import CompressionError  # noqa: E402


class Undecodable:
    """A codec that refuses every payload (as a bad header would make ours)."""

    def extract(self, message):
        raise CompressionError("1 payloads, expected 2")


from muloco.comm.aggregate import aggregate  # noqa: E402


def test_contribution_checks():
    shapes = [torch.Size([2, 3]), torch.Size([3])]
    good = [torch.zeros(2, 3), torch.zeros(3)]
    assert contribution_problem(good, shapes) is None
    assert "expected 2" in contribution_problem(good[:1], shapes)
    assert "shape" in contribution_problem([torch.zeros(3, 2), torch.zeros(3)], shapes)
    assert "dtype" in contribution_problem([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3)], shapes)
    assert "non-finite" in contribution_problem([torch.zeros(2, 3), torch.tensor([0, math.inf, 0])], shapes)


def test_norm_outliers_use_the_lower_median():
    assert set(norm_outliers({"a": 1.0, "b": 1.2, "c": 100.0}, 10.0)) == {"c"}
    assert set(norm_outliers({"a": 1.0, "b": 100.0}, 10.0)) == {"b"}  # two peers: the bigger is caught
    assert norm_outliers({"a": 1.0, "b": 9.0}, 10.0) == {}
    assert norm_outliers({"a": 0.0, "b": 0.0, "c": 5.0}, 10.0) == {}  # median 0: flags nothing
    assert norm_outliers({"a": 1.0}, 10.0) == {}


def test_mean_in_order():
    mean = aggregate([[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]], "mean")
    assert torch.equal(mean[0], torch.tensor([2.0, 4.0]))


def test_every_exclusion_reason_has_its_kind_and_only_own_non_finite_is_left_out():
    """Issue 37: each reason the exchange, the transfer and the checks give, by kind (a peer at another
    step must never read as non-finite)."""
    shapes = [torch.Size([2])]
    reasons = {
        _metadata_problem({"step": 3, "rule": ["mean", 1], "token": b"t" * 16}, 5, ("mean", 1)): "other_step",
        _metadata_problem({"step": 5, "rule": ["mean", 1], "token": None}, 5, ("mean", 1)): "non_finite",
        _metadata_problem({"step": 5, "rule": ["median", 1], "token": b"t" * 16}, 5, ("mean", 1)): "rule",
        _metadata_problem({"step": "5"}, 5, ("mean", 1)): "malformed",
        contribution_problem([torch.tensor([math.nan, 0.0])], shapes): "non_finite",
        contribution_problem([torch.zeros(3)], shapes): "malformed",
        checked_download([], b"t", [], shapes): "download",
        checked_download([wrap_payload(b"x")], b"not its token", [], shapes): "token_mismatch",
        checked_download(
            Exclusion("download", "download timed out after 5.0 s"), b"t", [], shapes
        ): "download",
        checked_download([wrap_payload(b"x")], b"t", [None, None], shapes): "truncated",
        next(iter(norm_outliers({"a": 1.0, "b": 1.0, "c": 50.0}, 10.0).values())): "outlier",
        SwarmAuth("run", b"k" * 32).check("peer", "group metadata", b"forged", 1): "auth",
        SwarmAuth("run", allowed_peers=["other"]).check("peer", "group metadata", b"", 1): "auth",
        withheld("tensor 0 holds non-finite values"): "non_finite",
        checked_download(
            [wrap_payload(b"x")], payload_token([wrap_payload(b"x")]), [Undecodable()], shapes
        ): "malformed",
    }
    assert {reason: exclusion_kind(reason) for reason in reasons} == reasons
    assert all(isinstance(reason, Exclusion) for reason in reasons)  # every producer tags its kind
    assert exclusion_kind("an untagged text") == "malformed"
    assert pickle.loads(pickle.dumps(withheld("x"))).kind == "non_finite"
    other_step = _metadata_problem({"step": 2, "rule": ["mean", 1], "token": b"t" * 16}, 5, ("mean", 1))
    result = AverageResult(None, 4, 3, True, {"me": withheld("x"), "a": other_step})
    assert result.exclusions("me") == (1, {"other_step": 1})
    assert result.exclusions("a") == (0, {"non_finite": 1, "other_step": 1})
