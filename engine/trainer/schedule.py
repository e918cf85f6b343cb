"""Learning-rate schedules as multipliers of the base rate (for ``LambdaLR``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.config import RunConfig


def lr_lambda(
    warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> Callable[[int], float]:
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


def minis_per_epoch(cfg: RunConfig) -> int:
    """Optimiser steps per PPO epoch: the step's prompts split into mini-batches."""
    t = cfg.trainer
    return t.prompts_per_step // (t.ppo_mini_batch_size or t.prompts_per_step)


def optimizer_and_schedule(
    model: torch.nn.Module, cfg: RunConfig, *, fused: bool = False
) -> tuple[torch.optim.AdamW, Callable[[int], float]]:
    """AdamW over the trainable parameters, and the LR multiplier per optimiser step over the whole
    run (``total_steps x ppo_epochs x mini-batches`` updates); every trainer backend uses both.

    ``fused`` selects torch's fused AdamW kernel (one kernel over every parameter instead of about
    ten tensor ops per parameter: the same update to float rounding, 2x faster on a small model
    on a CPU); the plain torch backend asks for it, DeepSpeed's ZeRO keeps the default.
    """
    o, t = cfg.optimizer, cfg.trainer
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}
    try:
        optimizer = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    except RuntimeError:  # parameters of a dtype or device the fused kernel does not take
        optimizer = torch.optim.AdamW(params, **kwargs)
    total_updates = t.total_steps * t.ppo_epochs * minis_per_epoch(cfg)
    return optimizer, lr_lambda(o.warmup_steps, total_updates, o.schedule, o.min_lr_ratio)
