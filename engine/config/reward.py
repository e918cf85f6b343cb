"""How completions are scored (``reward``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from engine.config.section import Section


class RewardFunctionConfig(Section):
    name: str = Field(
        ...,
        title="Reward function",
        description="A registered reward (math, exact_match, format, overlong, ...) or 'module:function'.",
        min_length=1,
    )
    weight: float = Field(1.0, title="Weight", description="Weight of this component in the total reward.")
    params: dict[str, Any] = Field(
        default_factory=dict, title="Parameters", description="Keyword arguments of the reward function."
    )


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="task")],
        title="Reward functions",
        description="Weighted components; 'task' is the built-in task's own verifier.",
        min_length=1,
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        title="Timeout (s)",
        description="Per-call limit; a call over it scores 0 and is counted.",
    )
    workers: int = Field(1, ge=1, le=64, title="Reward workers", description="Processes scoring completions.")
    worker_memory_mb: int = Field(
        8192,
        ge=512,
        le=262144,
        title="Reward worker memory (MB)",
        description="Address space each scoring process may use; an allocation beyond it scores that call as an error.",
    )
    worker_cpu_s: int = Field(
        3600,
        ge=10,
        le=7 * 24 * 3600,
        title="Reward worker CPU time (s)",
        description="CPU seconds a scoring process may use in its life; past it the process is replaced.",
    )

    @field_validator("functions")
    @classmethod
    def _known_functions(cls, v: list[RewardFunctionConfig], info: ValidationInfo) -> list[RewardFunctionConfig]:
        # User modules are not imported here: the web app validates configs it never runs. Which
        # ones may be named is the policy's call: the caller's (build_config(reward_policy=...)),
        # else this process's environment (engine/rewards/policy.py).
        from engine.rewards import validate_reward_functions

        policy = (info.context or {}).get("reward_policy")
        validate_reward_functions(v, import_user=False, policy=policy)
        return v
