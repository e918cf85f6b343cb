"""Policy-gradient losses and their registry (verl 0.9.1: ``core_algos.register_policy_loss`` & co.).

Every loss has verl's signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None) -> (pg_loss, pg_metrics)

* ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask``: ``[bs, T]``; ``log_prob``
  carries the gradient, the others are data.
* ``loss_agg_mode``: see :func:`engine.algorithms.aggregation.agg_loss`.
* ``config``: a :class:`engine.algorithms.configs.PolicyLossConfig` (``None``: its defaults); the
  losses read ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
  ``tau_pos``, ``tau_neg``, ``loss_scale_factor`` and ``global_batch_info``.
* ``rollout_is_weights``: optional ``[bs, T]`` importance weights (rollout-vs-trainer mismatch
  correction) multiplied into the per-token loss before aggregation.
* ``pg_metrics``: python floats under verl's keys ``"actor/pg_clipfrac"``, ``"actor/ppo_kl"``,
  ``"actor/pg_clipfrac_lower"`` (``gpg`` returns none).

The ratio is ``r = pi_theta / pi_old = exp(log_prob - old_log_prob)``; ``ppo_kl`` is the masked
mean of ``old_log_prob - log_prob`` (a k1 estimate of KL(pi_old || pi_theta)).

Registered names: ``vanilla``, ``gspo``, ``cispo``, ``sapo``, ``gpg``, ``geo_mean``, ``dppo_tv``,
``dppo_kl``. verl's ``clip_cov``, ``kl_cov`` (random token selection), ``dro`` and
``bypass_mode`` are not provided.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.algorithms.aggregation import agg_loss
from engine.algorithms.configs import PolicyLossConfig
from engine.algorithms.masked_ops import masked_mean

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "ROW_MEAN_LOSSES",
    "PolicyLossFn",
    "compute_policy_loss_cispo",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "get_policy_loss_fn",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]

POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}

ROW_MEAN_LOSSES = frozenset({"geo_mean"})
"""Losses averaged over the rows they are given rather than against ``global_batch_info`` (GMPO, as
in verl): leaving a zero-advantage row out changes their value, so the trainer never does."""

_DEFAULTS = PolicyLossConfig()


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register a policy loss under ``name`` (a later registration replaces it, as in verl)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered under ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


# ----------------------------------------------------------------------------- config helpers


def _resolved(config: PolicyLossConfig | None) -> PolicyLossConfig:
    return _DEFAULTS if config is None else config


def _clip_bounds(config: PolicyLossConfig | None) -> tuple[float, float]:
    """``(eps_low, eps_high)``: ``clip_ratio_low/high``, each falling back to ``clip_ratio`` when ``None``."""
    eps = _resolved(config).clip_ratio
    low = _resolved(config).clip_ratio_low
    high = _resolved(config).clip_ratio_high
    return (eps if low is None else low), (eps if high is None else high)


def _agg_kwargs(config: PolicyLossConfig | None) -> dict[str, Any]:
    """``global_batch_info`` as ``agg_loss`` keywords, plus ``loss_scale_factor`` from the config.

    verl's worker copies ``config.loss_scale_factor`` into ``global_batch_info`` before calling
    the loss; doing it here gives the same result when only the attribute is set.
    """
    cfg = _resolved(config)
    kwargs = dict(cfg.global_batch_info or {})
    if kwargs.get("loss_scale_factor") is None and cfg.loss_scale_factor is not None:
        kwargs["loss_scale_factor"] = cfg.loss_scale_factor
    return kwargs


def _metrics(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor) -> dict[str, float]:
    return {
        "actor/pg_clipfrac": clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": clipfrac_lower.detach().item(),
    }


# ----------------------------------------------------------------------------- losses


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347) with clip-higher and dual clip.

    Per token, with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``::

        L1 = -A * r
        L2 = -A * clip(r, 1 - eps_low, 1 + eps_high)     # eps_* = clip_ratio_low/high (DAPO,
        L_clip = max(L1, L2)                             #   arXiv:2503.14476, "clip-higher")
        L = min(L_clip, -A * c)   if A < 0               # dual clip (Ye et al., arXiv:1912.09729),
        L = L_clip                otherwise              #   c = clip_ratio_c > 1

    The max makes the update pessimistic: once ``r`` has moved past the clip bound in the
    direction the advantage favours, the token's gradient is zero. For ``A < 0`` the dual clip
    caps the loss at ``-A * c`` so a huge ratio cannot produce an unbounded step (zero gradient
    beyond ``r > c``). The result is aggregated with ``agg_loss(L, response_mask, loss_agg_mode)``.

    Metrics: ``pg_clipfrac`` = masked fraction with ``L2 > L1``; ``ppo_kl``;
    ``pg_clipfrac_lower`` = masked fraction with ``A < 0`` and ``L_clip > -A * c``.
    """
    eps_low, eps_high = _clip_bounds(config)
    clip_ratio_c = _resolved(config).clip_ratio_c
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1.0, got {clip_ratio_c}")

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pessimistic = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)

    dual_cap = -advantages * clip_ratio_c
    dual_clipped = torch.min(dual_cap, pessimistic)
    pg_clipfrac_lower = masked_mean(torch.gt(pessimistic, dual_cap) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, dual_clipped, pessimistic)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al., arXiv:2507.18071), token form "GSPO-token".

    The importance ratio is per *sequence*, the geometric mean of the token ratios::

        log s_i = (1/|y_i|) * sum_t mask * (log_prob - old_log_prob)        # |y_i| >= 1
        log s_{i,t} = sg[log s_i] + log_prob_{i,t} - sg[log_prob_{i,t}]     # value: log s_i
        s_{i,t} = exp(min(log s_{i,t}, 10))
        L = max(-A * s_{i,t}, -A * clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

    Each token's value is the sequence ratio, while its gradient is ``s_i * grad log_prob_{i,t}``,
    so every token of a sequence is weighted by the same ratio and the whole sequence is clipped
    together. No dual clip and no +-20 clamp. Default aggregation ``seq-mean-token-mean`` as in the
    paper. The paper's ranges are tiny (e.g. 3e-4 / 4e-4), as sequence ratios stay near 1.

    Metrics: ``pg_clipfrac`` (masked fraction where the clipped term is larger), ``ppo_kl`` (token
    level), ``pg_clipfrac_lower`` = 0.
    """
    eps_low, eps_high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob

    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))

    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = torch.maximum(unclipped, clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))

    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, torch.tensor(0.0, device=pg_loss.device))


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, section 3.1).

    Clip the importance weight, not the update::

        r = exp(clamp(log_prob - old_log_prob, -20, 20))
        L = -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log_prob

    Every token keeps a gradient ``-clip(r) * A * grad log_prob`` (PPO would zero the clipped
    ones). ``eps_low``/``eps_high`` are ``clip_ratio_low``/``clip_ratio_high`` (fallback
    ``clip_ratio``), as in verl; the paper leaves the lower bound effectively off (large
    ``eps_low``) and tunes only ``eps_high``.

    Metrics: ``pg_clipfrac`` = masked fraction with ``clip(r) != r``; ``ppo_kl``;
    ``pg_clipfrac_lower`` = 0.
    """
    eps_low, eps_high = _clip_bounds(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    weight = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = -weight.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != weight).float(), response_mask)

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, torch.tensor(0.0, device=pg_loss.device))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347): a smooth gate instead of a hard clip.

    ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``; ``tau = tau_pos if A > 0 else tau_neg``;
    ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau`` (slope 1 at ``r = 1``, saturating away from it);
    ``L = -f(r) * A``. As in verl the loss is **always** aggregated with ``seq-mean-token-mean``:
    ``loss_agg_mode`` is ignored. Metrics: ``ppo_kl``; both clip fractions are 0.
    """
    tau_pos = torch.as_tensor(_resolved(config).tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(_resolved(config).tau_neg, dtype=advantages.dtype, device=advantages.device)

    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gate * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **_agg_kwargs(config))

    zero = torch.tensor(0.0, device=pg_loss.device)
    return pg_loss, _metrics(zero, masked_mean(-log_ratio, response_mask), zero)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GPG (arXiv:2504.02546): plain policy gradient ``L = -A * log_prob``, no ratio, no clip.

    ``old_log_prob`` is unused. Returns an empty metrics dict (as verl).
    """
    pg_losses = -log_prob * advantages
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config)), {}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al., arXiv:2507.20673).

    Token log-ratios ``d = log_prob - old_log_prob`` are clipped in log space to
    ``[-eps_low, eps_high]`` pessimistically (``sgn(A) * min(sgn(A) d, sgn(A) clip(d))``), then
    ``rho_i = exp(masked mean_t of the clipped d)`` (a geometric mean of ratios),
    ``A_i = masked mean_t A``, ``L_i = -A_i * rho_i`` and the loss is the plain mean over rows
    (``loss_agg_mode`` and ``global_batch_info`` are ignored, as in verl). ``rollout_is_weights``
    enter through their per-sequence geometric mean.

    Metrics: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = masked fraction of tokens whose ``d`` lies
    outside the range with ``A > 0`` / ``A < 0``; ``ppo_kl``.
    """
    eps_low, eps_high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)

    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -eps_low, eps_high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)

    lengths = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((pessimistic * response_mask).sum(dim=-1) / (lengths + 1e-8))
    seq_adv = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    pg_losses = -seq_adv * seq_ratio
    if rollout_is_weights is not None:
        log_w = (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (lengths + 1e-8)
        pg_losses = pg_losses * torch.exp(log_w)
    pg_loss = torch.mean(pg_losses)

    outside = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((outside * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((outside * (advantages < 0)).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _dppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig | None,
    rollout_is_weights: torch.Tensor | None,
    trust_region: Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, Any]]:
    low, high = _clip_bounds(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    cap = _resolved(config).clip_ratio_c
    truncated = torch.clamp(ratio, max=cap).detach()

    keep_pos, keep_neg = trust_region(log_prob, old_log_prob, low, high)
    keep = torch.where(advantages > 0, keep_pos, keep_neg).detach().float()

    pg_losses = -advantages * truncated * log_prob * keep
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **_agg_kwargs(config))

    pg_clipfrac = masked_mean((1.0 - keep).float(), response_mask)
    pg_clipfrac_lower = masked_mean((ratio > cap).float() * keep, response_mask)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _tv_region(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    return change <= high, change >= -low


def _binary_kl_region(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    return (binary_kl <= high) | (prob <= old_prob), (binary_kl <= low) | (prob >= old_prob)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """DPPO-Binary-TV (arXiv:2602.04879): a trust region on the sampled token's probability change.

    A token is kept when ``p - p_old <= clip_ratio_high`` (``A > 0``) or
    ``p - p_old >= -clip_ratio_low`` (``A <= 0``); here the clip ratios are total-variation
    thresholds, not ratio epsilons. ``L = -A * sg[min(r, clip_ratio_c)] * log_prob * keep``
    (truncated IS instead of dual clip; ``clip_ratio_c`` defaults to 20 only for configs without
    that attribute). Metrics: ``pg_clipfrac`` = dropped fraction, ``pg_clipfrac_lower`` = kept
    fraction with ``r > clip_ratio_c``, ``ppo_kl``.
    """
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _tv_region,
    )


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """DPPO-Binary-KL (arXiv:2602.04879): like ``dppo_tv`` with a binary-KL trust region.

    ``KL_b = p_old log(p_old/p) + (1-p_old) log((1-p_old)/(1-p))`` (1e-8 guards). For ``A > 0``
    keep when ``KL_b <= clip_ratio_high`` or the probability went down; for ``A <= 0`` keep when
    ``KL_b <= clip_ratio_low`` or it went up. Loss and metrics as ``dppo_tv``.
    """
    return _dppo_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        _binary_kl_region,
    )
