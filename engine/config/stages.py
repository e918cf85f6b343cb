"""Continual training (``data.stages``): an ordered list of stages trained one after another in one run.

A stage is a prompt source (a built-in task or a dataset, the ``data.*`` fields it overrides; the
rest it inherits from ``data``), a number of steps, and optionally a reward of its own. Stage i
trains steps ``start_i + 1 .. start_i + steps_i`` (``start_0 = 0``, ``start_{i+1} = start_i + steps_i``),
and the stages' steps add up to ``trainer.total_steps``: the stage switches at its first step, in the
prompts drawn and in the reward that scores them. Every eval point evaluates every stage seen so far
(each on its own held-out prompts), and each stage's last step is an eval point too, so the run
records the continual-learning accuracy matrix R[i][j] (accuracy on stage j after stage i; Lopez-Paz
and Ranzato 2017, "Gradient Episodic Memory for Continual Learning", NeurIPS) that forgetting is read
from (``engine/pipeline/stages.py``).

The forgetting guard ``replay.previous_stages`` draws a fixed share of each batch's prompts from
the earlier stages' training prompts (general replay: RECAP, arXiv:2510.21978; GeRe, arXiv:2508.04676).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from engine.config.reward import RewardFunctionConfig
from engine.config.section import Section

if TYPE_CHECKING:
    from engine.config.model_data import DataConfig
    from engine.config.run import RunConfig

STAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
"""A stage name: it becomes part of metric names (``eval/<stage>/accuracy``, ``forgetting/<stage>``),
so no ``/``, no spaces, no capitals (two names differing only in case would read alike)."""

OVERRIDES = (
    "source",
    "task",
    "difficulty",
    "train_size",
    "eval_size",
    "path",
    "eval_path",
    "split",
    "fields",
    "prompt_template",
    "system_prompt",
)
"""The ``data.*`` fields a stage may set for itself (unset: the value of ``data``)."""


class StageConfig(Section):
    """One stage of ``data.stages``: what it trains on, for how many steps, with which reward."""

    name: str = Field(
        ...,
        title="Stage name",
        description="Unique; lower-case letters, digits, '-' and '_' (at most 32, starting with a letter or "
        "digit): it names the stage's metrics (eval/<name>/accuracy, forgetting/<name>).",
    )
    steps: int = Field(
        ..., ge=1, title="Steps", description="Steps this stage trains; the stages' steps add up to trainer.total_steps."
    )
    source: Literal["builtin", "jsonl", "parquet", "disk"] | None = Field(
        None, title="Prompt source", description="This stage's data.source (unset: data.source)."
    )
    task: Literal["arithmetic", "countdown"] | None = Field(
        None, title="Built-in task", description="This stage's data.task (unset: data.task)."
    )
    difficulty: int | None = Field(
        None, ge=1, le=5, title="Difficulty", description="This stage's data.difficulty (unset: data.difficulty)."
    )
    train_size: int | None = Field(
        None, ge=1, title="Train prompts", description="This stage's data.train_size (unset: data.train_size)."
    )
    eval_size: int | None = Field(
        None, ge=0, title="Eval prompts", description="This stage's data.eval_size (unset: data.eval_size)."
    )
    path: str | None = Field(None, title="Train file", description="This stage's data.path (unset: data.path).")
    eval_path: str | None = Field(
        None, title="Eval file", description="This stage's data.eval_path (unset: data.eval_path)."
    )
    split: str | None = Field(None, title="Split", description="This stage's data.split (unset: data.split).")
    fields: dict[str, Any] | None = Field(
        None,
        title="Field mapping",
        description="This stage's data.fields, e.g. {\"prompt\": \"question\"} (unset or empty: data.fields).",
    )
    prompt_template: str | None = Field(
        None, title="Prompt template", description="This stage's data.prompt_template (unset: data.prompt_template)."
    )
    system_prompt: str | None = Field(
        None, title="System prompt", description="This stage's data.system_prompt (unset: data.system_prompt)."
    )
    reward_functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        title="Reward functions",
        description="This stage's own reward.functions (empty: the run's; timeout and workers are always the "
        "run's). They score the stage's prompts wherever they appear: its training batches, its evaluation, and "
        "its prompts replayed in later stages.",
    )

    @field_validator("reward_functions")
    @classmethod
    def _known_functions(
        cls, v: list[RewardFunctionConfig], info: ValidationInfo
    ) -> list[RewardFunctionConfig]:
        # As reward.functions: user modules are checked against the policy, not imported.
        if v:
            from engine.rewards import validate_reward_functions

            try:
                validate_reward_functions(v, import_user=False, policy=(info.context or {}).get("reward_policy"))
            except ValueError as exc:
                raise ValueError(str(exc).replace("reward.functions", "reward_functions")) from None
        return v

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not STAGE_NAME.fullmatch(v):
            raise ValueError(
                f"stage name {v!r} is not usable in metric names; use 1-32 lower-case letters, digits, '-' or '_', "
                "starting with a letter or digit (e.g. 'arith-easy')"
            )
        return v

    def data_config(self, data: DataConfig) -> DataConfig:
        """This stage's data config: ``data`` with the fields this stage sets, and no stages of its own."""
        from engine.config.model_data import DataConfig

        merged = data.model_dump(exclude={"stages"})
        merged.update({k: getattr(self, k) for k in OVERRIDES if getattr(self, k) not in (None, {})})
        return DataConfig.model_validate(merged)


def check_stage_list(stages: list[StageConfig], data: DataConfig) -> None:
    """``data.stages`` on its own: unique names, and each stage's merged data config valid."""
    seen: set[str] = set()
    for i, stage in enumerate(stages):
        if stage.name in seen:
            raise ValueError(f"data.stages[{i}].name: {stage.name!r} names an earlier stage too; give each stage its own name")
        seen.add(stage.name)
        try:
            stage.data_config(data)
        except ValueError as exc:
            raise ValueError(f"data.stages[{i}] ({stage.name}): {_first_message(exc)}") from None


def _first_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        msg = str(first.get("msg", exc)).removeprefix("Value error, ")
        return f"{loc + ': ' if loc else ''}{msg}"
    return str(exc)


def check_stages(cfg: RunConfig) -> None:
    """The rules of ``data.stages`` and ``replay.previous_stages`` that span sections."""
    stages = cfg.data.stages
    fraction = cfg.replay.previous_stages
    if not stages:
        if cfg.data.stage_reference != "initial":
            raise ValueError(
                "data.stage_reference: 'previous_stage' needs data.stages; set data.stages or use 'initial'"
            )
        if fraction > 0:
            raise ValueError(
                "replay.previous_stages: replays earlier stages' prompts, but data.stages is empty; "
                "set data.stages or replay.previous_stages 0"
            )
        return
    total = sum(s.steps for s in stages)
    if total != cfg.trainer.total_steps:
        raise ValueError(
            f"data.stages: the stages' steps add up to {total} but trainer.total_steps is {cfg.trainer.total_steps}; "
            f"set trainer.total_steps to {total} or change the stages' steps"
        )
    if cfg.async_.partial_rollouts:
        raise ValueError(
            "data.stages: stages do not combine with async.partial_rollouts yet (a group in flight would cross the "
            "stage boundary); set async.partial_rollouts false"
        )
    for i, stage in enumerate(stages):
        data = stage.data_config(cfg.data)
        functions = stage.reward_functions or cfg.reward.functions
        if cfg.model.path == "starter" and data.source != "builtin":
            raise ValueError(
                f"data.stages[{i}].source: 'starter' (model.path) is trained on the stages' built-in tasks (a mixture "
                "starter when they differ); set model.path to a model directory for a stage that is not built-in"
            )
        if data.source != "builtin" and any(f.name == "task" for f in functions):
            where = f"data.stages[{i}].reward_functions" if stage.reward_functions else "reward.functions"
            raise ValueError(
                f"{where}: 'task' is the built-in task's verifier, but stage {stage.name!r} reads "
                f"{data.source} data; give the stage reward_functions (math, exact_match or your own module:function)"
            )
    if cfg.data.stage_reference == "previous_stage":
        if not (cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward):
            raise ValueError(
                "data.stage_reference: 'previous_stage' changes the KL term's reference, but the run has none; "
                "set algorithm.use_kl_loss (or use_kl_in_reward) true, or data.stage_reference 'initial'"
            )
        if cfg.trainer.backend != "torch":
            raise ValueError(
                "data.stage_reference: 'previous_stage' needs trainer.backend 'torch' (each DeepSpeed rank holds "
                "a reference of its own); use 'initial' with DeepSpeed"
            )
    if fraction > 0:
        k = cfg.trainer.prompts_per_step
        replayed = round(fraction * k)
        if replayed == 0 or replayed >= k:
            raise ValueError(
                f"replay.previous_stages: {fraction} x trainer.prompts_per_step {k} rounds to {replayed} replayed "
                f"prompts per batch; it must be between 1 and {k - 1} (change the fraction or prompts_per_step)"
            )
        if len(stages) < 2:
            raise ValueError(
                "replay.previous_stages: a run of one stage has no earlier stage to replay; add stages or set it to 0"
            )


def stage_bounds(stages: list[StageConfig]) -> list[tuple[int, int]]:
    """``(first, last)`` step of each stage (1-based, inclusive)."""
    out, start = [], 0
    for s in stages:
        out.append((start + 1, start + s.steps))
        start += s.steps
    return out


def stage_at(stages: list[StageConfig], step: int) -> int:
    """Index of the stage that trains step ``step`` (step 0, before training, is the first stage's;
    a step past the end is the last stage's)."""
    for i, (_, last) in enumerate(stage_bounds(stages)):
        if step <= last:
            return i
    return len(stages) - 1
