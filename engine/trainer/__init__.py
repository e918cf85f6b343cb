"""Trainer backends: the optimisation step over a policy (plain torch; DeepSpeed on GPUs).

``make_trainer("torch", model, cfg, device=..., need_reference=...)`` builds one by name; every
backend implements :class:`TrainerBackend` (see ``engine/trainer/base.py``). ``"deepspeed"``
(``engine/trainer/deepspeed_backend.py``) imports DeepSpeed, so its module is imported only when it
is chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.trainer.base import TrainerBackend
from engine.trainer.torch_backend import TorchTrainer

if TYPE_CHECKING:
    from engine.config import RunConfig

__all__ = ["BACKENDS", "TorchTrainer", "TrainerBackend", "make_trainer"]


def _deepspeed_trainer(
    model: torch.nn.Module, cfg: RunConfig, *, device: torch.device, need_reference: bool
) -> TrainerBackend:
    from engine.trainer.deepspeed_backend import DeepSpeedTrainer

    return DeepSpeedTrainer(model, cfg, device=device, need_reference=need_reference)


BACKENDS: dict[str, Callable[..., TrainerBackend]] = {"torch": TorchTrainer, "deepspeed": _deepspeed_trainer}
"""Backend name (``trainer.backend``) -> constructor ``(model, cfg, *, device, need_reference)``."""


def make_trainer(
    name: str, model: torch.nn.Module, cfg: RunConfig, *, device: torch.device, need_reference: bool
) -> TrainerBackend:
    """Build the trainer backend called ``name`` around ``model``; an unknown name raises ``ValueError``
    listing the known ones."""
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown trainer backend {name!r}: known backends are {', '.join(sorted(BACKENDS))}"
        ) from None
    return factory(model, cfg, device=device, need_reference=need_reference)
