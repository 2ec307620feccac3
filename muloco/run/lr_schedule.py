"""The inner learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio (or constant)."""

from __future__ import annotations

import math


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Multiplier of the base lr at inner step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
