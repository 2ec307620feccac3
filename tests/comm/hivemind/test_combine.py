"""The group's combine rule (muloco/comm/hivemind/combine.py): which contributions count, and the mean."""

import math

import pytest
import torch

pytest.importorskip("hivemind")

from muloco.comm.hivemind import contribution_problem, norm_outliers  # noqa: E402
from muloco.sync.aggregate import aggregate  # noqa: E402


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
