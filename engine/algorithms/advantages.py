"""Advantage estimators and their registry (verl 0.9.1: ``core_algos.register_adv_est`` & co.).

Every estimator returns ``(advantages, returns)``, both ``[bs, response_len]`` and detached, and
takes keyword arguments with verl's names:

* ``token_level_rewards`` ``[bs, T]``: rewards per token; outcome-reward estimators use only the
  row sum ``s_i = sum_t r_{i,t}`` (the "score"), so where the reward sits does not matter to them.
* ``response_mask`` ``[bs, T]``: 1 for response tokens; advantages are zero where it is 0.
* ``index``: one group id per row (``np.ndarray``, list or tensor; in verl the prompt ``uid``).
  Rows with equal ids are the ``G`` responses to one prompt.
* ``epsilon``, ``norm_adv_by_std_in_grpo``, ``config`` (an :class:`~engine.algorithms.configs.AlgoConfig`:
  ``gamma``, ``norm_adv_by_std_in_grpo``; ``None`` for its defaults) and estimator-specific extras.

Registered names: ``grpo``, ``grpo_vectorized``, ``grpo_passk``, ``grpo_median`` (alias ``mc_grpo``;
not in verl), ``rloo``, ``rloo_vectorized``, ``opo``, ``gpg``, ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``: the critic-free estimators, which need nothing beyond the sampled
groups. verl's ``gae`` (a value model) and ``remax`` (a greedy baseline rollout per prompt) are not
provided, as the engine trains neither; nor are ``gdpo`` and the ``optimal_token_baseline`` pair.

Group conventions shared with verl: a group of one has baseline 0 and scale 1 (its advantage is
its raw score) except in ``rloo_vectorized`` (0) and ``grpo_passk`` (error). Standard deviations
are unbiased (``torch.std``), so a group of one would have none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from engine.algorithms.configs import AlgoConfig
from engine.algorithms.masked_ops import masked_whiten

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "compute_gpg_outcome_advantage",
    "compute_grpo_median_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "get_adv_estimator_fn",
    "grpo_median_pivot_mask",
    "register_adv_est",
]

GroupIndex = np.ndarray | Sequence[Any] | torch.Tensor

ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _name_of(name_or_enum: str | Enum) -> str:
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(name_or_enum: str | Enum) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register an advantage estimator under ``name`` (a string or a string-valued Enum).

    Registering a *different* function under a taken name raises ``ValueError`` (as verl does);
    registering the same function again is a no-op.
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = _name_of(name_or_enum)
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered to {existing!r}")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | Enum) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The estimator registered under ``name``; ``ValueError`` listing the known names otherwise."""
    name = _name_of(name_or_enum)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


# ----------------------------------------------------------------------------- grouping helpers


def _group_keys(index: GroupIndex, batch_size: int) -> list[Any]:
    if isinstance(index, torch.Tensor | np.ndarray):
        keys = index.reshape(-1).tolist()
    else:
        keys = list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} group ids for a batch of {batch_size} rows")
    return keys


def _group_rows(index: GroupIndex, batch_size: int, device: torch.device) -> list[torch.Tensor]:
    """Row indices of each group, groups in order of first appearance, rows in batch order."""
    rows: dict[Any, list[int]] = {}
    for row, key in enumerate(_group_keys(index, batch_size)):
        rows.setdefault(key, []).append(row)
    return [torch.tensor(r, dtype=torch.long, device=device) for r in rows.values()]


def _group_ids(index: GroupIndex, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group id ``0..G-1`` per row (numbered by first appearance)."""
    ids: dict[Any, int] = {}
    dense = [ids.setdefault(key, len(ids)) for key in _group_keys(index, batch_size)]
    return torch.tensor(dense, dtype=torch.long, device=device)


_DEFAULTS = AlgoConfig()


def _norm_flag(norm_adv_by_std_in_grpo: bool | None, config: AlgoConfig | None) -> bool:
    if norm_adv_by_std_in_grpo is not None:
        return bool(norm_adv_by_std_in_grpo)
    return bool((config or _DEFAULTS).norm_adv_by_std_in_grpo)


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # verl's group-of-one statistics are default-dtype (float32) 0-dim tensors; keep that promotion.
    return torch.tensor(value, device=like.device)


# ----------------------------------------------------------------------------- group baselines


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = True,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (DeepSeekMath, arXiv:2402.03300, section 4.1.2).

    For row ``i`` in group ``g`` with score ``s_i = sum_t r_{i,t}``::

        A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)   # norm_adv_by_std_in_grpo=True (GRPO)
        A_i =  s_i - mean_g(s)                           # False: Dr. GRPO, arXiv:2503.20783

    ``std_g`` is the unbiased sample std. A group of one uses mean 0 and std 1. ``A_i`` is
    broadcast to every response token: ``advantages[i, t] = A_i * response_mask[i, t]``.
    ``returns`` is the same tensor.

    ``norm_adv_by_std_in_grpo=None`` reads ``config.norm_adv_by_std_in_grpo`` (default True);
    verl only ever reads the keyword, whose default is True, so callers going through the
    registry with only ``config`` should pass the flag explicitly to be verl-exact.
    """
    normalise = _norm_flag(norm_adv_by_std_in_grpo, config)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            if rows.numel() == 1:
                mean, std = _scalar(0.0, group), _scalar(1.0, group)
            else:
                mean, std = torch.mean(group), torch.std(group)
            out[rows] = (group - mean) / (std + epsilon) if normalise else group - mean
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_vectorized")
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = True,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO computed with scatter-adds instead of a loop over groups (same formula as ``grpo``).

    Group statistics are taken in float32 (as verl does): ``mean_g = sum/count``,
    ``std_g = sqrt(sum((s - mean_g)^2) / max(count - 1, 1))``; groups of one use mean 0, std 1.
    Values can differ from ``grpo`` in the last float32 bits.
    """
    normalise = _norm_flag(norm_adv_by_std_in_grpo, config)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid = _group_ids(index, scores.shape[0], scores.device)
        num_groups = int(gid.max().item()) + 1 if gid.numel() else 0
        s32 = scores.to(torch.float32)
        count = torch.zeros(num_groups, device=scores.device).index_add_(0, gid, torch.ones_like(s32))
        mean = torch.zeros(num_groups, device=scores.device).index_add_(0, gid, s32) / count.clamp_min(1.0)
        sq = (s32 - mean[gid]) ** 2
        var = torch.zeros(num_groups, device=scores.device).index_add_(0, gid, sq) / (count - 1.0).clamp_min(
            1.0
        )
        std = torch.sqrt(torch.clamp(var, min=0.0))
        single = count <= 1.0
        mean = torch.where(single, 0.0, mean)
        std = torch.where(single, 1.0, std)
        if normalise:
            per_row = (scores - mean[gid]) / (std[gid] + epsilon)
        else:
            per_row = scores - mean[gid]
        advantages = per_row.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k-style advantage (arXiv:2503.19595, as referenced by verl): only the best response learns.

    In each group the top-scoring row gets ``A = s_max - s_second`` (divided by
    ``std_g + epsilon`` when normalising); all other rows get 0. Ties go to the index
    ``torch.topk`` returns. Every group needs at least two rows (``ValueError`` otherwise).

    As in verl, ``config.norm_adv_by_std_in_grpo`` (when a ``config`` is given) overrides the keyword.
    """
    normalise = bool(norm_adv_by_std_in_grpo if config is None else config.norm_adv_by_std_in_grpo)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.zeros_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            if group.numel() < 2:
                raise ValueError(f"grpo_passk needs at least 2 responses per group, got {group.numel()}")
            top, top_idx = torch.topk(group, 2)
            gap = top[0] - top[1]
            if normalise:
                gap = gap / (torch.std(group) + epsilon)
            out[rows[top_idx[0]]] = gap
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_median")
@register_adv_est("mc_grpo")
def compute_grpo_median_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool | None = None,
    config: AlgoConfig | None = None,
    scale: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Median-centred group baseline, MC-GRPO (Kim, "MC-GRPO: Median-Centered Group Relative Policy
    Optimization for Small-Rollout Reinforcement Learning", arXiv:2601.22582). Not in verl 0.9.1.

    With few rollouts per prompt the group *mean* is noisy and flips the sign of some advantages;
    the *median* is robust to one outlier. For row ``i`` in group ``g``::

        A_i = (s_i - median_g(s)) / (S_g + epsilon)

    ``median_g`` is ``torch.median`` (for an even group the lower of the two middle values, so it
    is always one of the scores). ``S_g`` depends on ``scale``:

    * ``"std"``: the unbiased group std, as GRPO (default when normalising);
    * ``"mad"``: median absolute deviation ``median_g(|s - median_g(s)|)``, as in the authors'
      code; beware that with 0/1 rewards the MAD is usually 0 and advantages become ``1/epsilon``;
    * ``"none"``: no scaling (``A_i = s_i - median_g``), the Dr. GRPO analogue.

    ``scale=None`` means ``"std"`` if normalising else ``"none"``, where the normalising flag is
    ``norm_adv_by_std_in_grpo`` or, when that is ``None``, ``config.norm_adv_by_std_in_grpo``
    (default True). A group of one uses baseline 0 and scale 1.

    The paper samples ``G + 1`` rollouts (an odd group), so exactly one row, the *pivot*, sits on
    the median and has advantage 0; it then drops that row from the loss so ``G`` rows contribute.
    An estimator cannot change the loss mask: use :func:`grpo_median_pivot_mask` to find the
    pivots and drop them (or zero their ``response_mask``) before the policy update. The paper's
    code also rescales the non-zero advantages of each group by ``(G+1) / #nonzero``; that is not
    done here.
    """
    if scale is None:
        scale = "std" if _norm_flag(norm_adv_by_std_in_grpo, config) else "none"
    if scale not in ("std", "mad", "none"):
        raise ValueError(f"grpo_median: unknown scale {scale!r}; known: ['std', 'mad', 'none']")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            if rows.numel() == 1:
                centre, spread = _scalar(0.0, group), _scalar(1.0, group)
            else:
                centre = torch.median(group)
                if scale == "std":
                    spread = torch.std(group)
                elif scale == "mad":
                    spread = torch.median((group - centre).abs())
                else:
                    spread = None
            out[rows] = group - centre if spread is None else (group - centre) / (spread + epsilon)
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


def grpo_median_pivot_mask(token_level_rewards: torch.Tensor, index: GroupIndex) -> torch.Tensor:
    """MC-GRPO pivots: ``[bs]`` bool, True for one row per group of two or more rows.

    The pivot is the first row (in batch order) whose score equals the group median used by
    ``grpo_median``. Keep ``~mask`` rows for the policy update to follow the paper (arXiv:2601.22582).
    """
    scores = token_level_rewards.sum(dim=-1)
    mask = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    for rows in _group_rows(index, scores.shape[0], scores.device):
        if rows.numel() < 2:
            continue
        group = scores[rows]
        hits = torch.nonzero(group == torch.median(group)).flatten()
        mask[rows[hits[0]]] = True
    return mask


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al., "Back to Basics", arXiv:2402.14740, section 3.2).

    The baseline of each response is the mean score of the *other* responses of its prompt::

        A_i = s_i - (1/(G-1)) * sum_{j != i} s_j  =  G/(G-1) * (s_i - mean_g(s))

    For a group of one there are no others, and verl leaves the raw score: ``A_i = s_i``
    (whereas ``rloo_vectorized`` gives 0). Broadcast over the response mask.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            n = rows.numel()
            if n > 1:
                mean = torch.mean(group)
                out[rows] = group * n / (n - 1) - mean * n / (n - 1)
            else:
                out[rows] = group
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740) with bincounts: ``A_i = (G*s_i - sum_g(s)) / (G-1)``.

    Same as ``rloo`` for groups of two or more; a group of one gets **0** here (verl's two RLOO
    implementations disagree on that case).
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid = _group_ids(index, scores.shape[0], scores.device)
        count = torch.bincount(gid)[gid].to(scores.dtype)
        total = torch.bincount(gid, weights=scores)[gid]
        per_row = ((count * scores - total) / (count - 1).clamp_min(1)) * (count > 1)
        advantages = per_row.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO's length-weighted optimal baseline (Hao et al., arXiv:2505.23585).

    ``b_g = sum_i |o_i| s_i / sum_i |o_i|`` with ``|o_i| = sum_t response_mask[i, t]``;
    ``A_i = s_i - b_g`` (a group of one: ``b_g = 0``), broadcast over the mask.
    """
    with torch.no_grad():
        lengths = response_mask.sum(dim=-1)
        scores = token_level_rewards.sum(dim=-1)
        out = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            if rows.numel() == 1:
                baseline = _scalar(0.0, group)
            else:
                group_len = lengths[rows]
                baseline = (group_len * group).sum() / group_len.sum()
            out[rows] = group - baseline
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG advantage (Chu et al., "GPG: A Simple and Strong RL Baseline", arXiv:2504.02546).

    ``A_i = alpha * (s_i - mean_g(s)) / f_norm`` with ``alpha = bs / max(#{i: s_i != 0}, 1)``,
    which re-weights the batch when many responses score 0. As in verl, the ``alpha`` argument is
    accepted but *ignored* (always recomputed). A group of one has mean 0.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        batch_size = scores.shape[0]
        alpha = batch_size / torch.count_nonzero(scores).clamp(min=1)
        out = torch.empty_like(scores)
        for rows in _group_rows(index, batch_size, scores.device):
            group = scores[rows]
            mean = _scalar(0.0, group) if rows.numel() == 1 else torch.mean(group)
            out[rows] = alpha * (group - mean) / f_norm
        advantages = out.unsqueeze(-1) * response_mask
    return advantages, advantages


# ----------------------------------------------------------------------------- REINFORCE++


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv:2501.03262): discounted return-to-go, whitened over the whole batch.

    ``G_t = r_t + gamma * G_{t+1}`` right to left, with ``gamma = config.gamma`` (1.0 without a config).
    Masked positions store 0 and pass the running return through unchanged (multi-turn
    observations). ``advantages = masked_whiten(G, mask) * mask`` (mean and unbiased std over all
    response tokens of the batch); ``returns = G``. No group baseline: ``index`` is ignored.
    Needs at least two response tokens in the batch.
    """
    gamma = (config or _DEFAULTS).gamma
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running: torch.Tensor | float = 0.0
        for t in reversed(range(token_level_rewards.shape[1])):
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * mask[:, t]
            running = candidate * mask[:, t] + running * (1 - mask[:, t])
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    config: AlgoConfig | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu, arXiv:2501.03262): group-mean baseline, then batch whitening.

    ``a_i = s_i - mean_g(s)`` (a group of one: mean 0), broadcast to the response tokens, then
    ``advantages = masked_whiten(a, mask) * mask`` over all response tokens of the batch (so
    longer responses weigh more in the batch statistics). No discounting; ``epsilon`` is unused.
    ``returns`` is the same tensor.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centred = torch.empty_like(scores)
        for rows in _group_rows(index, scores.shape[0], scores.device):
            group = scores[rows]
            mean = _scalar(0.0, group) if rows.numel() == 1 else torch.mean(group)
            centred[rows] = group - mean
        per_token = centred.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
        advantages = masked_whiten(per_token, response_mask) * response_mask
    return advantages, advantages
