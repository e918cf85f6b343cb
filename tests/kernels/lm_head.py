"""Random LM-head inputs and the values-and-gradients harness that the tests of every logprob
implementation (fused torch, Triton) run them through, so that each is measured the same way."""

from __future__ import annotations

import torch


def make_inputs(
    n: int, h: int, v: int, *, dtype: torch.dtype = torch.float32, bias: bool = True, seed: int = 0
) -> dict[str, torch.Tensor | None]:
    """``hidden [n, h]``, ``weight [v, h]``, ``labels [n]`` and ``bias [v]`` (or None) of ``dtype``.

    Drawn in float32 (float64 for float64) and then cast, so that a half-precision input is the
    rounding of the float32 one."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "hidden": torch.randn(n, h, generator=gen, dtype=draw).to(dtype),
        # logits O(1-10): peaked but not one-hot distributions
        "weight": (torch.randn(v, h, generator=gen, dtype=draw) * (2.0 / h**0.5)).to(dtype),
        "labels": torch.randint(0, v, (n,), generator=gen),
        "bias": torch.randn(v, generator=gen, dtype=draw).to(dtype) if bias else None,
    }


def upstream_grads(
    n: int, dtype: torch.dtype = torch.float32, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights ``(a, b)`` of the loss ``sum(a * logp + b * H)`` that :func:`values_and_grads` backprops."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen, dtype=dtype), torch.randn(n, generator=gen, dtype=dtype)


def values_and_grads(fn, inputs: dict, upstream: tuple, **kwargs) -> list[torch.Tensor]:
    """``[logprobs, entropy, grad_hidden, grad_weight(, grad_bias)]`` of ``sum(a * logp + b * H)``,
    ``fn`` run on fresh leaf copies of ``inputs``."""
    leaves = {
        k: (t.detach().clone().requires_grad_(True) if k != "labels" and t is not None else t)
        for k, t in inputs.items()
    }
    logprobs, entropy = fn(
        leaves["hidden"], leaves["weight"], leaves["labels"], bias=leaves["bias"], **kwargs
    )
    a, b = upstream
    (a * logprobs + b * entropy).sum().backward()
    grads = [leaves[k].grad for k in ("hidden", "weight", "bias") if leaves[k] is not None]
    return [logprobs.detach(), entropy.detach(), *grads]
