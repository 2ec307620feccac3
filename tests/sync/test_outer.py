"""The outer step against hand-derived Nesterov SGD (DiLoCo Algorithm 1 with torch.optim.SGD semantics)."""

import torch

from muloco.sync.outer import OuterOptimizer, nesterov_outer_step


def test_two_outer_steps_match_hand_computation():
    theta, lr, m = torch.tensor([1.0, -2.0]), 0.7, 0.6
    buf = torch.zeros(2)
    d1, d2 = torch.tensor([0.1, 0.2]), torch.tensor([-0.3, 0.05])
    nesterov_outer_step([theta], [d1], [buf], lr, m, nesterov=True)
    # b1 = d1; u1 = d1 + m b1 = 1.6 d1
    expected = torch.tensor([1.0, -2.0]) - lr * 1.6 * d1
    assert torch.allclose(theta, expected)
    nesterov_outer_step([theta], [d2], [buf], lr, m, nesterov=True)
    b2 = m * d1 + d2
    expected = expected - lr * (d2 + m * b2)
    assert torch.allclose(theta, expected)


def test_matches_torch_sgd_nesterov_and_plain_momentum():
    torch.manual_seed(0)
    for nesterov in (True, False):
        p_ref = torch.nn.Parameter(torch.randn(5, 3))
        ref = torch.optim.SGD([p_ref], lr=0.7, momentum=0.9, nesterov=nesterov)
        outer = OuterOptimizer(
            [("w", p_ref.detach().clone())], lr=0.7, momentum=0.9, nesterov=nesterov, device="cpu"
        )
        for _ in range(4):
            delta = torch.randn(5, 3)
            p_ref.grad = delta.clone()
            ref.step()
            outer.step([delta])
        assert torch.allclose(outer.params[0], p_ref.detach(), atol=1e-6)


def test_outer_lr_one_momentum_zero_moves_to_the_average_replica():
    theta = torch.tensor([2.0, 4.0])
    replicas = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 1.0])]
    avg_delta = sum(theta - r for r in replicas) / 2
    nesterov_outer_step([theta], [avg_delta], [torch.zeros(2)], lr=1.0, momentum=0.0)
    assert torch.allclose(theta, sum(replicas) / 2)
