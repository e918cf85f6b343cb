"""One check for the trainer and kernel tests that two ways of computing response log-probs (the
shared-prompt forward, the Triton kernels, ...) are the same computation."""

from __future__ import annotations

import torch
from torch import nn

from engine.batch import RolloutBatch
from engine.trainer.actor import LogprobSettings, response_logprobs


def assert_same_logprobs_and_grads(
    model: nn.Module,
    batch: RolloutBatch,
    reference: LogprobSettings,
    other: LogprobSettings,
    weights: torch.Tensor | float = 1.0,
) -> None:
    """``response_logprobs`` under ``other`` gives the log-probs, entropies and parameter gradients
    (of ``sum((logp + 0.1 * H) * weights * response_mask)``) that it gives under ``reference``, to
    float32 rounding."""
    results = []
    for settings in (reference, other):
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, settings, compute_entropy=True)
        ((lp + 0.1 * ent) * weights * batch.response_mask).sum().backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
