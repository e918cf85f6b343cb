"""Reduce a per-token loss matrix to the scalar that is back-propagated (verl: ``core_algos.agg_loss``).

The choice of reduction is an algorithmic choice, not a detail: it decides how much each token
and each sequence weighs in the gradient.

=============================  =====================================================  ==============
mode                           formula (``M`` = mask, ``L`` = loss, ``B`` sequences)  used by
=============================  =====================================================  ==============
``token-mean``                 ``sum(L*M) / sum(M)``                                  DAPO, verl
``token-sum``                  ``sum(L*M)``                                           --
``seq-mean-token-sum``         ``mean_i sum_t L*M``                                   --
``seq-mean-token-mean``        ``mean_i (sum_t L*M / sum_t M)``                       GRPO, GSPO
``seq-mean-token-sum-norm``    ``mean_i sum_t L*M / loss_scale_factor``               Dr. GRPO
=============================  =====================================================  ==============

In the ``seq-mean-*`` modes the mean runs over sequences with at least one unmasked token.
``seq-mean-token-sum-norm`` divides by a constant (default: the padded response length ``T``,
i.e. ``loss_mask.shape[-1]``) instead of each sequence's own length, which removes GRPO's length
bias (Dr. GRPO, "Understanding R1-Zero-Like Training", arXiv:2503.20783, section 3.1).
DAPO's token-level mean: arXiv:2503.14476, section 3.3.
"""

from __future__ import annotations

import torch

from engine.algorithms.masked_ops import masked_sum

__all__ = ["LOSS_AGG_MODES", "agg_loss"]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [bs, T] under ``loss_mask`` [bs, T] into a scalar.

    Args:
        loss_mat: per-token losses of this micro batch, ``[bs, T]``.
        loss_mask: 1 for tokens that count, ``[bs, T]``.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (see the module docstring).
        dp_size: number of data-parallel ranks whose gradients are *averaged*. Each rank's loss is
            multiplied by it so that the averaged gradient equals the gradient of the loss over the
            global batch. With ``dp_size > 1`` the global denominators below are required.
        batch_num_tokens: ``token-mean`` denominator: unmasked tokens in the *global* batch
            (default: this micro batch's ``sum(loss_mask)``).
        global_batch_size: ``seq-mean-*`` denominator: sequences in the global batch
            (default: this micro batch's sequences that have an unmasked token).
        loss_scale_factor: ``seq-mean-token-sum-norm`` divisor (default: ``T = loss_mask.shape[-1]``);
            set it to a constant (e.g. the maximum response length) to keep the scale fixed
            when batches are padded to different lengths.

    Returns:
        0-dim tensor. An all-zero mask gives NaN (0/0), as in verl.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss: token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
        has_tokens = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss: {loss_agg_mode} with dp_size > 1 needs the global_batch_size")
            global_batch_size = has_tokens.sum()
        loss = masked_sum(per_seq, has_tokens) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss = loss / loss_scale_factor
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        tokens_per_seq = torch.sum(loss_mask, dim=-1)
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1) / (tokens_per_seq + 1e-8)
        has_tokens = (tokens_per_seq > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("agg_loss: seq-mean-token-mean with dp_size > 1 needs the global_batch_size")
            global_batch_size = has_tokens.sum()
        return masked_sum(per_seq, has_tokens) / global_batch_size * dp_size
    raise ValueError(f"agg_loss: unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")
