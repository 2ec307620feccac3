"""A user's own optimizer, named as `inner.optimizer=custom_optimizer:SignDescent` (tests/ is on the path):
signed descent with momentum, the kind of one-file optimizer a researcher brings to a comparison."""

import torch


class SignDescent(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(state["momentum"].sign(), alpha=-group["lr"])
        return None


class NotAnOptimizer:
    def __init__(self, params, lr: float = 1e-3) -> None:
        self.params = list(params)
