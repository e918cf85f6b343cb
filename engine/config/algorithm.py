"""How advantages and the loss are computed (``algorithm``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from engine.config.section import Section
from engine.contracts import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    KLControllerType,
    LossAggMode,
)

# The fields named from a registry: what each names, and the names it accepts.
_NAMED: dict[str, tuple[str, tuple[str, ...]]] = {
    "adv_estimator": ("advantage estimator", ADV_ESTIMATORS),
    "policy_loss": ("policy loss", POLICY_LOSSES),
    "kl_loss_type": ("KL estimator", KL_ESTIMATORS),
    "kl_penalty": ("KL estimator", KL_ESTIMATORS),
}


class FilterGroupsConfig(Section):
    enable: bool = Field(
        False,
        title="Dynamic sampling",
        description="DAPO: drop groups whose rewards are all equal and keep sampling until the batch is full.",
    )
    metric: Literal["score", "acc"] = Field(
        "score", title="Filter metric", description="Group statistic checked for zero variance."
    )
    max_num_gen_batches: int = Field(
        8,
        ge=1,
        title="Max generation rounds",
        description="Cap on sampling rounds per step before training anyway.",
    )
    round_size: Literal["full", "deficit"] = Field(
        "full",
        title="Regeneration round size",
        description="full: every round samples a whole batch of prompts (DAPO; verl's gen_batch_size). "
        "deficit: a round after the first samples the groups still missing divided by the share of "
        "groups kept so far in the step, so fewer groups are generated only to be thrown away.",
    )


class KLRewardControllerConfig(Section):
    """``algorithm.kl_ctrl``: the controller of the KL coefficient in the reward (``use_kl_in_reward``)."""

    type: KLControllerType = Field("fixed", title="KL controller")
    kl_coef: float = Field(0.001, ge=0.0, title="KL coefficient (reward)")
    target_kl: float = Field(0.1, gt=0.0, title="Target KL (adaptive)")
    horizon: int = Field(10_000, ge=1, title="Horizon (adaptive)")


class AlgorithmConfig(Section):
    adv_estimator: str = Field(
        "grpo",
        title="Advantage estimator",
        description="grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, grpo_median (MC-GRPO), ...",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, title="Normalise by group std", description="False gives Dr. GRPO's unbiased advantages."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, title="Discount (REINFORCE++)")
    policy_loss: str = Field(
        "vanilla", title="Policy loss", description="vanilla (PPO clip), gspo, cispo, ..."
    )
    clip_ratio: float = Field(
        0.2, gt=0.0, title="Clip ratio", description="PPO epsilon, both sides by default."
    )
    clip_ratio_low: float = Field(0.2, ge=0.0, title="Clip ratio low", description="Lower epsilon.")
    clip_ratio_high: float = Field(
        0.2, ge=0.0, title="Clip ratio high", description="Upper epsilon (DAPO clip-higher: 0.28)."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1.0, title="Dual-clip c", description="Dual-clip bound for negative advantages (> 1)."
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        title="Loss aggregation",
        description="token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO).",
    )
    loss_scale_factor: float | None = Field(
        None,
        gt=0,
        title="Loss scale factor",
        description="Constant divisor for seq-mean-token-sum-norm (default: max response tokens).",
    )
    entropy_coeff: float = Field(
        0.0, ge=0.0, title="Entropy bonus", description="Coefficient of -entropy in loss."
    )
    use_kl_loss: bool = Field(
        False, title="KL loss", description="Add a KL(policy || reference) term to the loss."
    )
    kl_loss_coef: float = Field(0.001, ge=0.0, title="KL loss coefficient")
    kl_loss_type: str = Field(
        "low_var_kl", title="KL loss estimator", description="k1/kl, k2/mse, k3/low_var_kl, abs."
    )
    use_kl_in_reward: bool = Field(
        False, title="KL in reward", description="Subtract a KL penalty from rewards."
    )
    kl_penalty: str = Field(
        "kl", title="KL reward estimator", description="k1/kl, k2/mse, k3/low_var_kl, abs."
    )
    kl_ctrl: KLRewardControllerConfig = Field(default_factory=KLRewardControllerConfig, title="KL reward controller")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, title="Dynamic sampling")
    overlong_filter: bool = Field(
        False, title="Overlong filtering", description="Mask truncated completions out of the loss (DAPO)."
    )

    # The names are checked against engine.contracts, not the registries of engine.algorithms: the
    # web app validates configs without loading torch (tests/engine/test_contracts.py keeps the two
    # equal). A KL estimator may carry a '+' suffix (straight-through k2 gradient).
    @field_validator("adv_estimator", "policy_loss", "kl_loss_type", "kl_penalty")
    @classmethod
    def _known_name(cls, v: str, info: ValidationInfo) -> str:
        what, names = _NAMED[info.field_name]
        name = v.removesuffix("+") if names is KL_ESTIMATORS else v
        if name not in names:
            plus = " (optionally with '+')" if names is KL_ESTIMATORS else ""
            raise ValueError(f"unknown {what} {v!r}; known: {sorted(names)}{plus}")
        return v
