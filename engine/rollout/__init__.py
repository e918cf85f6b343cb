"""Rollout backends: generate ``n`` completions per prompt with sampling-time log-probabilities.

``make_rollout_backend("torch", model, tokenizer, max_batch_size=...)`` builds one by name; every
backend implements :class:`RolloutBackend` (see ``engine/rollout/base.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.rollout.base import (
    Completion,
    FinishReason,
    PromptCompletions,
    RolloutBackend,
    SamplingParams,
)

__all__ = [
    "BACKENDS",
    "Completion",
    "FinishReason",
    "PromptCompletions",
    "RolloutBackend",
    "SamplingParams",
    "make_rollout_backend",
]


def _torch_backend(model: Any, tokenizer: Any, **kwargs: Any) -> RolloutBackend:
    from engine.rollout.torch_backend import TorchRolloutBackend

    return TorchRolloutBackend(model, tokenizer, **kwargs)


BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"torch": _torch_backend}
"""Backend name -> constructor ``(model, tokenizer, **kwargs)``; imported lazily (vLLM is optional)."""


def make_rollout_backend(name: str, model: Any, tokenizer: Any, **kwargs: Any) -> RolloutBackend:
    """Build the rollout backend called ``name`` for ``model`` and ``tokenizer``.

    ``kwargs`` go to the backend's constructor (torch: ``device``, ``max_batch_size``,
    ``policy_version``). An unknown name raises ``ValueError`` listing the known ones.
    """
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout backend {name!r}: known backends are {', '.join(sorted(BACKENDS))}"
        ) from None
    return factory(model, tokenizer, **kwargs)
