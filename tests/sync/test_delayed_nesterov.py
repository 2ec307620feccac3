"""Delayed Nesterov (sync/delayed_nesterov.py) against Algorithm 3 of Liu et al. 2024 worked by hand, and
against synchronous DiLoCo's Nesterov step: with c = 0 a window of N arrivals is one Nesterov step on their
mean."""

import pytest
import torch

from muloco.sync.delayed_nesterov import DelayedNesterov
from muloco.sync.outer import nesterov_outer_step


def test_one_window_worked_by_hand():
    """N = 2, c = 0.25, lr 0.5, beta 0.9, scalars: g = 2, then 4, then 6."""
    theta = [torch.tensor([10.0])]
    dn = DelayedNesterov(theta, lr=0.5, momentum=0.9, every=2, c=0.25)
    dn.arrive([torch.tensor([2.0])])  # no fold: theta -= 0.5 (0.25 x 0.9 x 0 + 2 / 2) = 0.5
    assert theta[0].item() == pytest.approx(9.5)
    dn.arrive(
        [torch.tensor([4.0])]
    )  # fold: m = 0 + (2 + 4) / 2 = 3; theta -= 0.5 ((1 - 0.5 + 0.25) 0.9 x 3 + 2)
    assert dn.momentum_buffers[0].item() == pytest.approx(3.0)
    assert theta[0].item() == pytest.approx(9.5 - 0.5 * (0.75 * 0.9 * 3 + 2))
    before = theta[0].item()
    dn.arrive([torch.tensor([6.0])])  # no fold: theta -= 0.5 (0.25 x 0.9 x 3 + 3); m unchanged
    assert theta[0].item() == pytest.approx(before - 0.5 * (0.25 * 0.9 * 3 + 3))
    assert dn.momentum_buffers[0].item() == pytest.approx(3.0) and dn.pending[0].item() == pytest.approx(6.0)


def test_a_window_of_n_arrivals_is_one_nesterov_step_on_their_mean():
    torch.manual_seed(0)
    shapes = [(4, 3), (5,)]
    start = [torch.randn(s) for s in shapes]
    delayed, synced = [p.clone() for p in start], [p.clone() for p in start]
    dn = DelayedNesterov(delayed, lr=0.7, momentum=0.9, every=4)
    buffers = [torch.zeros(s) for s in shapes]
    for _window in range(3):
        arrivals = [[torch.randn(s) for s in shapes] for _ in range(4)]
        for g in arrivals:
            dn.arrive(g)
        mean = [sum(g[i] for g in arrivals) / 4 for i in range(len(shapes))]
        nesterov_outer_step(synced, mean, buffers, lr=0.7, momentum=0.9, nesterov=True)
        for a, b in zip(delayed, synced, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_round_trips_and_bad_settings_are_refused():
    theta = [torch.ones(3)]
    dn = DelayedNesterov(theta, lr=0.1, momentum=0.9, every=3)
    dn.arrive([torch.ones(3)])
    copy = DelayedNesterov([theta[0].clone()], lr=0.1, momentum=0.9, every=3)
    copy.load_state_dict(dn.state_dict())
    assert copy.arrivals == 1 and torch.equal(copy.pending[0], dn.pending[0])
    with pytest.raises(ValueError, match=r"c in \[0, 1/N\]"):
        DelayedNesterov(theta, lr=0.1, momentum=0.9, every=4, c=0.5)
