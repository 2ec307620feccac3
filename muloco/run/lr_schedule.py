"""The inner learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio, constant, or
warmup-stable-decay (wsd: constant, then a linear decay to min_lr_ratio over the last decay_fraction of the
steps after warmup; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
Durations", whose 20% linear cooldown matches cosine). wsd places the decay by the run's own horizon: runs
of different lengths share their stable phase."""

from __future__ import annotations

import math


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the base lr at inner step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * (total_steps - warmup_steps)))
        into_decay = step - (total_steps - decay_steps)
        return 1.0 if into_decay < 0 else 1.0 - (1.0 - min_lr_ratio) * min(1.0, into_decay / decay_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
