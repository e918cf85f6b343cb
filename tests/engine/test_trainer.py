"""Trainer pieces: LR schedule, exact gradient accumulation across micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from engine.algorithms import agg_loss
from engine.data import Prompt
from engine.models import load_model
from engine.pipeline.batch import Rollout, RolloutBatch, collate
from engine.rollout import Completion
from engine.trainer.actor import LogprobSettings, global_batch_info, response_logprobs
from engine.trainer.schedule import lr_lambda

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def test_warmup_then_cosine_to_floor() -> None:
    f = lr_lambda(warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    g = lr_lambda(warmup_steps=0, total_steps=10, schedule="constant", min_lr_ratio=0.0)
    assert {g(s) for s in range(20)} == {1.0}


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_add_up_to_the_whole_mini_batch(mode: str) -> None:
    """With the mini-batch's global_batch_info, micro-batch losses must sum to the mini-batch's
    loss whatever the response lengths (one row fully masked, as the overlong filter does):
    otherwise gradient accumulation changes the objective."""
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 7, generator=gen)
    lengths = torch.randint(1, 8, (10,), generator=gen)
    mask = (torch.arange(7) < lengths.unsqueeze(1)).float()
    mask[5] = 0.0
    whole = agg_loss(loss_mat=loss, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=7)
    info = global_batch_info(mask, loss_scale_factor=7)
    parts = [
        agg_loss(loss_mat=loss[rows], loss_mask=mask[rows], loss_agg_mode=mode, **info)
        for rows in (slice(0, 3), slice(3, 4), slice(4, 10))
    ]
    assert math.isclose(float(sum(parts)), float(whole), rel_tol=1e-6, abs_tol=1e-7)


def _random_batch(vocab: int, groups: int = 4, n: int = 3, seed: int = 0) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(groups):
        p_len = int(torch.randint(2, 7, (1,), generator=gen))
        prompt_ids = torch.randint(3, vocab, (p_len,), generator=gen).tolist()
        prompt = Prompt(uid=f"p{g}", text="", raw="")
        for _ in range(n):
            r_len = int(torch.randint(1, 6, (1,), generator=gen))
            ids = torch.randint(3, vocab, (r_len,), generator=gen).tolist()
            completion = Completion(ids, [-1.0] * r_len, "", "stop", 0)
            rows.append(Rollout(prompt, prompt_ids, completion, 0.0, {}, group=f"g{g}"))
    order = torch.randperm(len(rows), generator=gen).tolist()  # mini-batches shuffle rows
    return collate([rows[i] for i in order], pad_id=0, policy_version=0)


def test_shared_prompt_forward_equals_the_full_forward(tiny_model_dir) -> None:
    """Running each group's prompt once must give the same log-probs, entropies and
    gradients as running every prompt + response sequence whole."""
    model = load_model(tiny_model_dir)
    model.train()
    batch = _random_batch(model.config.vocab_size)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for shared in (False, True):
        model.zero_grad()
        settings = LogprobSettings(temperature=0.7, shared_prompt=shared)
        lp, ent = response_logprobs(model, batch, settings, compute_entropy=True)
        ((lp + 0.1 * ent) * weights * batch.response_mask).sum().backward()
        results.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
