"""The whole run config: the sections together, and the rules that span them."""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field, model_validator

from engine.config.algorithm import AlgorithmConfig
from engine.config.async_rl import AsyncConfig
from engine.config.model_data import DataConfig, ModelConfig
from engine.config.replay import ReplayConfig
from engine.config.reward import RewardConfig
from engine.config.rollout import RolloutConfig
from engine.config.section import Section
from engine.config.stages import check_stages
from engine.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainerConfig


class RunConfig(Section):
    """A complete, validated RL run."""

    # ``async`` is a Python keyword: the field is ``async_``, spelled ``async`` in YAML, JSON and the schema.
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        title="Tributary run",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    name: str = Field("run", title="Run name", min_length=1, max_length=200)
    preset: str | None = Field(None, title="Preset", description="The preset this config started from.")
    output_dir: str = Field(
        "runs/{name}", title="Output directory", description="Checkpoints and the event log; may use {name}."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, title="Model")
    data: DataConfig = Field(default_factory=DataConfig, title="Data")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, title="Rollout")
    reward: RewardConfig = Field(default_factory=RewardConfig, title="Reward")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, title="Algorithm")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, title="Optimizer")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, title="Trainer")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, title="Checkpointing")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, title="Logging")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", title="Asynchronous RL")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, title="Rollout replay")

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        if self.model.path == "starter" and self.data.source != "builtin":
            raise ValueError(
                "model.path: 'starter' is the built-in task's policy; set a model directory "
                "when data.source is not 'builtin'"
            )
        if self.data.source != "builtin" and any(f.name == "task" for f in self.reward.functions):
            raise ValueError(
                "reward.functions: 'task' is the built-in task's verifier; with data.source "
                f"'{self.data.source}' use math, exact_match or your own module:function"
            )
        if self.algorithm.filter_groups.enable and self.rollout.n < 2:
            raise ValueError(
                "algorithm.filter_groups.enable: needs rollout.n >= 2 (a group of one has no variance)"
            )
        if self.algorithm.filter_groups.round_size == "deficit" and self.async_.partial_rollouts:
            raise ValueError(
                "algorithm.filter_groups.round_size: 'deficit' sizes whole-group rounds; partial rollouts "
                "top up their pool of groups instead: set round_size 'full' or async.partial_rollouts false"
            )
        if self.trainer.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ValueError(
                f"trainer.mixed_precision: 'bf16' keeps float32 weights and computes in bfloat16; model.dtype is "
                f"'{self.model.dtype}' already, so set mixed_precision 'no' or model.dtype 'float32'"
            )
        if self.replay.enabled:
            self._check_replay()
        check_stages(self)  # data.stages, replay.previous_stages (engine/config/stages.py)
        return self

    def _check_replay(self) -> None:
        replayed = round(self.replay.ratio * self.trainer.prompts_per_step)
        if replayed == 0:
            raise ValueError(
                f"replay.ratio: {self.replay.ratio} x trainer.prompts_per_step {self.trainer.prompts_per_step} "
                "rounds to no replayed group; raise the ratio or prompts_per_step, or set ratio 0"
            )
        if self.async_.partial_rollouts:
            raise ValueError(
                "replay.ratio: rollout replay does not combine with async.partial_rollouts yet; "
                "set replay.ratio 0 or partial_rollouts false"
            )
        if self.async_.periodic:
            raise ValueError(
                "replay.ratio: rollout replay does not combine with async.periodic yet (the replayed rows "
                "would make each step recompute the log-probs periodic mode computes during generation); "
                "set replay.ratio 0 or periodic false"
            )
        if self.replay.max_age <= self.async_.max_staleness:
            raise ValueError(
                f"replay.max_age: {self.replay.max_age} versions; a group is at least async.max_staleness + 1 = "
                f"{self.async_.max_staleness + 1} versions old when replayed, so set max_age above that"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))
