"""Engine configs small enough for end-to-end tests of the worker and the web app on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_config(model_dir: Path, total_steps: int, *, name: str = "tiny", **trainer: Any) -> dict[str, Any]:
    """A run that takes a few seconds on a CPU (the settings of tests/engine/test_run.py, smaller)."""
    return {
        "name": name,
        "model": {"path": str(model_dir)},
        "data": {"source": "builtin", "task": "arithmetic", "train_size": 64, "eval_size": 4},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "trainer": {
            "prompts_per_step": 2,
            "ppo_mini_batch_size": 2,
            "ppo_epochs": 1,
            "micro_batch_size": 4,
            "eval_every": 0,
            "total_steps": total_steps,
            **trainer,
        },
        "checkpoint": {"every_steps": 0},
        "logging": {"samples_per_step": 2, "progress": "on", "heartbeat_s": 0.2},
    }
