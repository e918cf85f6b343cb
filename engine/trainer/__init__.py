"""Trainer backends: the optimisation step over a policy (plain torch; DeepSpeed on GPUs)."""

from engine.trainer.base import TrainerBackend
from engine.trainer.torch_backend import TorchTrainer

__all__ = ["TorchTrainer", "TrainerBackend"]
