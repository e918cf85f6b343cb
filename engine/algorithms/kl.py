"""KL estimators, KL-in-reward penalty and KL coefficient controllers (verl 0.9.1 names).

Per-token estimators of ``KL(pi || pi_ref)`` from samples ``x ~ pi`` (Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html). With ``d = logprob - ref_logprob``
(= ``log pi(x) - log pi_ref(x)``):

============================  ==================================  ===================================
name                          value                               note
============================  ==================================  ===================================
``k1`` / ``kl``               ``d``                               unbiased, high variance, can be < 0
``abs``                       ``|d|``                             biased
``k2`` / ``mse``              ``d^2 / 2``                         biased, low variance; its gradient
                                                                  is the unbiased KL gradient
``k3`` / ``low_var_kl``       ``exp(-d) + d - 1``                 unbiased, >= 0, low variance;
                                                                  ``-d`` clamped to [-20, 20], the
                                                                  result to [-10, 10]
============================  ==================================  ===================================

A ``+`` suffix (e.g. ``k3+``) gives a straight-through estimator: the value of the named estimator
and the gradient of ``k2``, because the expected gradients of k1 and k3 are not the gradient of KL.

Two ways to use KL: as a loss term (``use_kl_loss``: ``agg_loss(kl_penalty(...))``) or inside the
reward (``use_kl_in_reward``: :func:`apply_kl_penalty` with a controller for the coefficient).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.algorithms.masked_ops import masked_mean
from engine.contracts import KL_CONTROLLER_TYPES, KL_ESTIMATORS

if TYPE_CHECKING:
    from engine.config import KLRewardControllerConfig

__all__ = [
    "KL_PENALTY_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
]

# The estimator names, which the run config validates against too.
KL_PENALTY_MODES: tuple[str, ...] = KL_ESTIMATORS


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The value of estimator ``kl_penalty`` (no ``+`` suffix) per token; see the module table.

    ``"full"`` (needs whole-vocabulary distributions) raises ``NotImplementedError``; unknown names
    raise ``ValueError``.
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        k3 = (torch.exp(log_ratio) - log_ratio - 1).contiguous()
        return torch.clamp(k3, min=-10, max=10)
    if kl_penalty == "full":
        raise NotImplementedError("kl_penalty 'full' needs full-vocabulary log-probs and is not implemented")
    raise ValueError(
        f"unknown kl_penalty {kl_penalty!r}; known: {list(KL_PENALTY_MODES)} (optionally with '+')"
    )


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate ``[bs, T]`` between the policy (``logprob``) and the reference.

    ``kl_penalty`` is one of ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl``, optionally
    followed by ``+``: then the value is that estimator's and the gradient is k2's
    (``d(d^2/2)/dlogprob = logprob - ref_logprob``), by ``k2 - sg[k2] + sg[value]``.
    """
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    value = kl_penalty_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


_kl_estimate = kl_penalty  # apply_kl_penalty's parameter of the same name (verl's) shadows the function


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., "Fine-Tuning LMs from Human Preferences", arXiv:1909.08593).

    After each batch: ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``value *= 1 + e * n_steps / horizon``. The coefficient grows while the KL is above target.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the target after a batch of ``n_steps`` samples with mean KL ``current_kl``."""
        error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value *= 1 + error * n_steps / self.horizon


class FixedKLController:
    """Constant KL coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with :class:`AdaptiveKLController`)."""


def get_kl_controller(kl_ctrl: KLRewardControllerConfig) -> FixedKLController | AdaptiveKLController:
    """Build the controller the run config's ``algorithm.kl_ctrl`` section describes: ``type``
    ("fixed"/"adaptive"), ``kl_coef``, and for adaptive ``target_kl`` and ``horizon``.

    Unknown types raise ``ValueError``; an adaptive horizon <= 0 raises ``ValueError`` (the config
    refuses both; a section built without validation reaches these checks).
    """
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        if not kl_ctrl.horizon > 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {kl_ctrl.horizon}")
        return AdaptiveKLController(
            init_kl_coef=kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon
        )
    raise ValueError(f"unknown KL controller type {kl_ctrl.type!r}; known: {list(KL_CONTROLLER_TYPES)}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward (verl: ``ray_trainer.apply_kl_penalty``, on tensors instead of a DataProto).

    ``kld = kl_penalty(old_log_prob, ref_log_prob) * mask``; ``rewards = scores - beta * kld`` with
    ``beta = kl_ctrl.value`` read *before* the update. Then the controller is updated in place with
    ``current_kl`` = batch mean of per-sequence masked-mean KL and ``n_steps = bs``.

    Args:
        token_level_scores, old_log_prob, ref_log_prob, response_mask: ``[bs, T]``.
        kl_ctrl: a controller (see :func:`get_kl_controller`); mutated by ``update``.
        kl_penalty: estimator name (see :func:`kl_penalty`).

    Returns:
        ``(token_level_rewards [bs, T], metrics)`` with ``"actor/reward_kl_penalty"`` (current KL)
        and ``"actor/reward_kl_penalty_coeff"`` (the beta used).
    """
    kld = _kl_estimate(old_log_prob, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, mask=response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
