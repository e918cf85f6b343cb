"""Rollout backends: generate ``n`` completions per prompt with sampling-time log-probabilities.

``make_rollout_backend("torch", model, tokenizer, max_batch_size=...)`` builds one by name; every
backend implements :class:`RolloutBackend` (see ``engine/rollout/base.py``). ``"vllm"`` runs vLLM's
engine on the model directory (``engine/rollout/vllm_backend.py``); its module, and vLLM, are imported
only when it is chosen. Either can run in a child process of its own (``rollout.own_process``):
``engine/rollout/process_backend.py`` wraps it behind the same protocol.
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


def _torch_backend(
    model: Any, tokenizer: Any, *, model_dir: Any = None, run_config: Any = None, **kwargs: Any
) -> RolloutBackend:
    from engine.rollout.torch_backend import TorchRolloutBackend

    return TorchRolloutBackend(model, tokenizer, **kwargs)


def _vllm_backend(
    model: Any, tokenizer: Any, *, model_dir: Any = None, run_config: Any = None, **kwargs: Any
) -> RolloutBackend:
    """vLLM loads its own copy of the weights from ``model_dir`` (the directory ``model`` came from).

    With ``run_config`` (a ``RunConfig``) the engine options come from ``rollout.vllm_*``, the dtype from
    ``model.dtype`` and the seed from ``trainer.seed``; explicit ``kwargs`` override them.
    """
    from engine.rollout.vllm_backend import VLLMRolloutBackend, import_vllm

    if model_dir is None:
        raise ValueError(
            "rollout backend 'vllm' needs model_dir: the local directory the policy model came from"
        )
    import_vllm()  # fails with the install extra to use before anything else is set up
    options: dict[str, Any] = {}
    if run_config is not None:
        rollout = run_config.rollout
        options = {
            "dtype": run_config.model.dtype,
            "seed": run_config.trainer.seed,
            "gpu_memory_utilization": rollout.vllm_gpu_memory_utilization,
            "kv_cache_gb": rollout.vllm_kv_cache_gb,
            "enforce_eager": rollout.vllm_enforce_eager,
            "prefix_caching": rollout.vllm_prefix_caching,
            "max_model_len": rollout.vllm_max_model_len,
        }
    options.update(kwargs)
    return VLLMRolloutBackend(model_dir, tokenizer, **options)


BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"torch": _torch_backend, "vllm": _vllm_backend}
"""Backend name -> constructor ``(model, tokenizer, **kwargs)``; imported lazily (vLLM is optional)."""


def make_rollout_backend(name: str, model: Any, tokenizer: Any, **kwargs: Any) -> RolloutBackend:
    """Build the rollout backend called ``name`` for ``model`` and ``tokenizer``.

    ``kwargs`` go to the backend's constructor (torch: ``device``, ``max_batch_size``,
    ``policy_version``; vllm: see :class:`~engine.rollout.vllm_backend.VLLMRolloutBackend`).
    ``model_dir`` (the model's local directory) and ``run_config`` (the run's ``RunConfig``) are accepted
    by every backend; vLLM needs ``model_dir`` and reads its options from ``run_config``. An unknown name
    raises ``ValueError`` listing the known ones.
    """
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown rollout backend {name!r}: known backends are {', '.join(sorted(BACKENDS))}"
        ) from None
    return factory(model, tokenizer, **kwargs)
