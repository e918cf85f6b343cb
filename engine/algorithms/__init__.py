"""RL post-training algorithms as pure torch functions, mirroring verl 0.9.1's ``core_algos``.

Names, signatures and semantics follow ``verl/trainer/ppo/core_algos.py`` (verl 0.9.1) so that a
paper, a verl recipe and this engine map one to one; the implementation is independent.

* :mod:`~engine.algorithms.advantages`: ``register_adv_est``, ``get_adv_estimator_fn`` and the
  estimators (``grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
  ``grpo_median`` / MC-GRPO, ...), each returning ``(advantages, returns)``.
* :mod:`~engine.algorithms.policy_losses`: ``register_policy_loss``, ``get_policy_loss_fn`` and the
  losses (``vanilla`` PPO/DAPO, ``gspo``, ``cispo``, ...), each returning ``(pg_loss, pg_metrics)``.
* :mod:`~engine.algorithms.aggregation`: ``agg_loss`` (token-mean, seq-mean-token-mean, ...).
* :mod:`~engine.algorithms.kl`: ``kl_penalty`` (k1/k2/k3/abs and ``+``), KL controllers and
  ``apply_kl_penalty`` (KL in the reward).
* :mod:`~engine.algorithms.entropy_and_value`: entropy bonus and clipped value loss.
* :mod:`~engine.algorithms.masked_ops`: ``masked_mean``/``masked_var``/``masked_whiten``.
* :mod:`~engine.algorithms.configs`: ``PolicyLossConfig``, ``AlgoConfig``, ``KLControlConfig``;
  the attribute names every function reads from its duck-typed ``config``.
"""

from engine.algorithms.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_median_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    grpo_median_pivot_mask,
    register_adv_est,
)
from engine.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from engine.algorithms.configs import AlgoConfig, KLControlConfig, PolicyLossConfig, config_value
from engine.algorithms.entropy_and_value import compute_entropy_loss, compute_value_loss, entropy_from_logits
from engine.algorithms.kl import (
    KL_PENALTY_MODES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
)
from engine.algorithms.masked_ops import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten
from engine.algorithms.policy_losses import (
    POLICY_LOSS_REGISTRY,
    PolicyLossFn,
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_PENALTY_MODES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AlgoConfig",
    "FixedKLController",
    "KLControlConfig",
    "PolicyLossConfig",
    "PolicyLossFn",
    "agg_loss",
    "apply_kl_penalty",
    "clip_by_value",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_median_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "config_value",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "grpo_median_pivot_mask",
    "kl_penalty",
    "kl_penalty_forward",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
