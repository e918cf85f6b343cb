"""Masked reductions over ``[batch, response_len]`` tensors (verl: ``verl.utils.torch_functional``).

``mask`` is 1 (or True) for tokens that count and 0 elsewhere; it may be bool, int or float.
Values outside the mask never leak into a result, even when they are NaN or inf.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """``sum(values * mask)`` over ``axis`` (all elements when ``None``), NaN-safe outside the mask."""
    kept = torch.where(mask.bool(), values, 0.0)
    return (kept * mask).sum(axis=axis)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """``sum(values * mask) / (sum(mask) + 1e-8)`` over ``axis``; an empty mask gives 0, not NaN."""
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (all of them, one scalar).

    ``var = masked_mean((x - masked_mean(x))^2)``, times ``n / (n - 1)`` when ``unbiased`` with
    ``n = sum(mask)``. Raises ``ValueError`` when ``unbiased`` and ``n`` is 0 or 1.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element")
        if count == 1:
            raise ValueError(
                "masked_var: the mask selects one element, the unbiased variance divides by zero"
            )
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten with masked statistics: ``(x - mean) / sqrt(var + 1e-8)`` (unbiased ``var``).

    With ``shift_mean=False`` the mean is added back after scaling. Every position is transformed,
    masked or not; multiply by the mask afterwards to zero the padding.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out

