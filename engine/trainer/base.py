"""The trainer backend protocol: what the orchestrator needs from whatever holds the policy.

The plain torch backend (one device) implements it here; a DeepSpeed ZeRO backend (GPU
machines) implements the same methods, gathering full weights for the rollout backend and
for checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from engine.batch import RolloutBatch


@runtime_checkable
class TrainerBackend(Protocol):
    @property
    def policy_version(self) -> int:
        """Number of training steps applied to the policy so far (the weights' version)."""
        ...

    def compute_log_probs(self, batch: RolloutBatch, *, reference: bool = False) -> torch.Tensor:
        """``[B, R]`` log-probs of the batch's responses under the policy (or the frozen reference)."""
        ...

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO epochs x mini-batches of optimiser steps on a batch with advantages; returns metrics."""
        ...

    def rollout_weights(self) -> Mapping[str, torch.Tensor]:
        """Full (unsharded) policy weights by parameter name, for the rollout backend."""
        ...

    def save(self, directory: Path) -> None:
        """Write the policy (safetensors, HF layout) and optimiser/scheduler state."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what ``save`` wrote."""
        ...

    def state(self) -> dict[str, Any]:
        """Small JSON-able state (versions, counters) for the checkpoint's state.json."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what ``state`` returned."""
        ...

    def close(self) -> None:
        """The run is over (however it ended): release what the backend holds (DeepSpeed's other ranks)."""
        ...
