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
* :mod:`~engine.algorithms.masked_ops`: ``masked_mean``/``masked_var``/``masked_whiten``.
* :mod:`~engine.algorithms.configs`: ``PolicyLossConfig``, ``AlgoConfig``: what the losses and the
  estimators read from their ``config``.
"""

# Each submodule's ``__all__`` names what it exports, once, where it is defined; the package
# re-exports all of it (``__all__ += module.__all__`` is the form type checkers follow through
# star imports).
# ruff: noqa: F403
from engine.algorithms import advantages, aggregation, configs, kl, masked_ops, policy_losses
from engine.algorithms.advantages import *
from engine.algorithms.aggregation import *
from engine.algorithms.configs import *
from engine.algorithms.kl import *
from engine.algorithms.masked_ops import *
from engine.algorithms.policy_losses import *

__all__: list[str] = []
__all__ += advantages.__all__
__all__ += aggregation.__all__
__all__ += configs.__all__
__all__ += kl.__all__
__all__ += masked_ops.__all__
__all__ += policy_losses.__all__
