"""Small frozen configs read by the algorithm functions.

The functions in :mod:`engine.algorithms` take one of these (or ``None`` for the defaults below);
the engine builds them from its run config. The attribute names and defaults are verl 0.9.1's,
so a verl recipe maps onto them one to one.

``PolicyLossConfig`` -- what the policy losses read (verl: the matching fields of ``ActorConfig``):

=====================  ============  =========================================================
attribute              default       used by
=====================  ============  =========================================================
``clip_ratio``         0.2           fallback for the two below when they are ``None``
``clip_ratio_low``     0.2           lower epsilon, ratio floor ``1 - clip_ratio_low``
``clip_ratio_high``    0.2           upper epsilon, ratio cap ``1 + clip_ratio_high`` (DAPO)
``clip_ratio_c``       3.0           dual-clip bound (vanilla), IS truncation (dppo_*)
``loss_agg_mode``      "token-mean"  carried for callers; the losses take ``loss_agg_mode`` as
                                     an argument, exactly like verl
``loss_scale_factor``  None          divisor of ``seq-mean-token-sum-norm`` (None: horizon)
``tau_pos``            1.0           SAPO gate temperature, positive advantages
``tau_neg``            1.05          SAPO gate temperature, non-positive advantages
``global_batch_info``  {}            kwargs for :func:`agg_loss`: ``dp_size``,
                                     ``batch_num_tokens``, ``global_batch_size``,
                                     ``loss_scale_factor``
=====================  ============  =========================================================

Note verl's defaults: ``clip_ratio_low`` and ``clip_ratio_high`` are 0.2, not ``None``, so setting
only ``clip_ratio`` changes nothing unless the other two are set to ``None``.

``AlgoConfig`` -- what the advantage estimators read (verl: the matching fields of ``AlgoConfig``):
``gamma`` (1.0, REINFORCE++ discount), ``norm_adv_by_std_in_grpo`` (True).

:func:`~engine.algorithms.kl.get_kl_controller` reads the run config's own section
(``engine.config.KLRewardControllerConfig``, verl: ``KLControlConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AlgoConfig", "PolicyLossConfig"]


@dataclass(frozen=True)
class PolicyLossConfig:
    """Attributes read by the registered policy losses; defaults equal verl 0.9.1's ``ActorConfig``."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    global_batch_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AlgoConfig:
    """Attributes read by the advantage estimators; defaults equal verl 0.9.1's ``AlgoConfig``."""

    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
