"""Learning-rate schedules as multipliers of the base rate (for ``LambdaLR``)."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_steps`` updates, then constant or cosine decay to
    ``min_lr_ratio`` at ``total_steps`` (SGDR's half cosine, Loshchilov & Hutter 2017)."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
