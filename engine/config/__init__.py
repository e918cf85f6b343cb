"""The run configuration: one pydantic model per section, named presets, loading and errors.

Everything a user can set in the browser form is here, and the form is generated from
``RunConfig.model_json_schema()`` (titles, descriptions, bounds). Field names follow verl
where the concept is the same (``adv_estimator``, ``clip_ratio_high``, ``loss_agg_mode``,
``kl_loss_type``, ...) so that papers and verl recipes map one to one.

Defaults are tuned for the built-in tasks on the starter policy (a ~1M-parameter model
that learns on a CPU in minutes); real models want smaller learning rates and longer
responses, which a YAML file or ``--set`` supplies.

One module per group of sections (``model_data``, ``rollout``, ``reward``, ``algorithm``,
``training``, ``async_rl``), ``run`` for the whole, ``presets`` and ``loading``. Validating
a config loads neither torch nor the algorithms: names are checked against ``engine.contracts``.
"""

from engine.config.algorithm import AlgorithmConfig, FilterGroupsConfig, KLRewardControllerConfig
from engine.config.async_rl import AsyncConfig
from engine.config.loading import (
    MOVED_FIELDS,
    ConfigError,
    apply_overrides,
    build_config,
    deep_merge,
    describe_errors,
    json_schema,
    load_config,
    load_yaml,
    parse_override,
    read_config_file,
    resolve_preset,
)
from engine.config.model_data import DataConfig, FieldMapping, ModelConfig, SelectionOptions
from engine.config.presets import PRESETS
from engine.config.replay import ReplayConfig
from engine.config.reward import RewardConfig, RewardFunctionConfig
from engine.config.rollout import RolloutConfig
from engine.config.run import RunConfig
from engine.config.section import Section
from engine.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainerConfig

__all__ = [
    "MOVED_FIELDS",
    "PRESETS",
    "AlgorithmConfig",
    "AsyncConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "FieldMapping",
    "FilterGroupsConfig",
    "KLRewardControllerConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ReplayConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "RunConfig",
    "Section",
    "SelectionOptions",
    "TrainerConfig",
    "apply_overrides",
    "build_config",
    "deep_merge",
    "describe_errors",
    "json_schema",
    "load_config",
    "load_yaml",
    "parse_override",
    "read_config_file",
    "resolve_preset",
]
