"""Trainer pieces: LR schedule, exact gradient accumulation across micro-batches."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from engine import trainer as trainer_backends
from engine.algorithms import agg_loss
from engine.config import RunConfig, TrainerConfig
from engine.models import load_model
from engine.trainer.actor import LogprobSettings, global_batch_info
from engine.trainer.schedule import lr_lambda
from tests.engine.batches import random_batch
from tests.engine.logprob_agreement import assert_same_logprobs_and_grads

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


def test_shared_prompt_forward_equals_the_full_forward(tiny_model_dir) -> None:
    """Running each group's prompt once must give the same log-probs, entropies and
    gradients as running every prompt + response sequence whole."""
    model = load_model(tiny_model_dir)
    model.train()
    batch = random_batch(model.config.vocab_size)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))
    assert_same_logprobs_and_grads(
        model,
        batch,
        LogprobSettings(temperature=0.7, shared_prompt=False),
        LogprobSettings(temperature=0.7, shared_prompt=True),
        weights,
    )


def test_trainer_backends_are_chosen_by_name() -> None:
    """Every ``trainer.backend`` the config accepts has a constructor, and an unknown name is refused
    with the known ones listed."""
    accepted = set(typing.get_args(TrainerConfig.model_fields["backend"].annotation))
    assert set(trainer_backends.BACKENDS) == accepted
    with pytest.raises(ValueError, match="unknown trainer backend 'jax': known backends are deepspeed, torch"):
        trainer_backends.make_trainer("jax", torch.nn.Linear(1, 1), RunConfig(), device=torch.device("cpu"),
                                      need_reference=False)  # fmt: skip
