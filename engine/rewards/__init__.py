"""Rewards: a registry of verifiers and user functions, combined with weights per completion.

``RewardManager(functions, timeout_s=..., workers=...).score([RewardInput(...), ...])`` returns a
``RewardResult`` (weighted totals, per-component values, error and timeout counts). Built-ins:
``math`` (math-verify), ``exact_match``, ``format``, ``overlong`` (DAPO), ``length``, ``task``;
anything else is a user function given as ``package.module:function``.
"""

from engine.rewards import builtin as builtin
from engine.rewards.builtin import extract_prediction
from engine.rewards.manager import (
    RewardFunctionLike,
    RewardInput,
    RewardManager,
    RewardResult,
    validate_reward_functions,
)
from engine.rewards.registry import (
    INPUT_FIELDS,
    RewardParamError,
    get_reward_fn,
    register_reward,
    registered_rewards,
)

__all__ = [
    "INPUT_FIELDS",
    "RewardFunctionLike",
    "RewardInput",
    "RewardManager",
    "RewardParamError",
    "RewardResult",
    "extract_prediction",
    "get_reward_fn",
    "register_reward",
    "registered_rewards",
    "validate_reward_functions",
]
