"""The run's other checkpointed components: the replicas as one list and the RNG. The counters (progress,
bytes, the WAN projection) are the engine's (muloco/sync/counters.py)."""

from __future__ import annotations

from typing import Any

import torch


class StateList:
    """A list of stateful objects (the replicas, the dp streams) as one component."""

    def __init__(self, items: list) -> None:
        self.items = items

    def state_dict(self) -> list[dict[str, Any]]:
        return [item.state_dict() for item in self.items]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for item, state in zip(self.items, states, strict=True):
            item.load_state_dict(state)


class RngState:
    """torch's global RNG (and CUDA's on a GPU): dropout or sampling continue exactly after a resume."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if self.cuda else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if self.cuda and state["cuda"] is not None:
            torch.cuda.set_rng_state_all(state["cuda"])
