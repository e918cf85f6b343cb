"""The two auxiliary loss terms of PPO-style training: the entropy bonus and the clipped value loss.

verl 0.9.1 names: ``core_algos.compute_entropy_loss``, ``core_algos.compute_value_loss`` and
``verl.utils.torch_functional.entropy_from_logits``.
"""

from __future__ import annotations

import torch

from engine.algorithms.aggregation import agg_loss
from engine.algorithms.masked_ops import clip_by_value, masked_mean

__all__ = ["compute_entropy_loss", "compute_value_loss", "entropy_from_logits"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``.

    ``[..., V] -> [...]``; stable for large logits (no explicit ``log(p)``).
    """
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy: ``agg_loss(H(softmax(logits)), response_mask, loss_agg_mode)``.

    ``logits`` ``[bs, T, V]``, ``response_mask`` ``[bs, T]``. The trainer *subtracts*
    ``entropy_coeff`` times this from the policy loss (an entropy bonus).
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss (arXiv:1707.06347; clipping as in OpenAI baselines).

    ``v_clip = clip(vpreds, values - c, values + c)``;
    ``loss = 0.5 * agg_loss(max((vpreds - R)^2, (v_clip - R)^2))``. All tensors ``[bs, T]``;
    ``values`` are the old critic's predictions. The aggregation keywords are passed to
    :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: the scalar loss and the masked fraction of tokens where the
        clipped error is the larger one.
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    err = (vpreds - returns) ** 2
    err_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(err, err_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(err_clipped, err).float(), response_mask)
    return vf_loss, vf_clipfrac
