"""Rows whose advantages are all zero are left out of the update (``trainer.skip_zero_advantage``),
and the update stays the same computation.

The trainer relies on one property of every registered policy loss: a row with zero advantages adds
nothing to the loss or its gradient once the aggregation's denominators come from the whole
mini-batch (``global_batch_info``). A loss added later that breaks it (a term not multiplied by the
advantage, a batch statistic over all rows) fails here, by name.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.algorithms import LOSS_AGG_MODES, PolicyLossConfig
from engine.algorithms.policy_losses import POLICY_LOSS_REGISTRY, ROW_MEAN_LOSSES
from engine.batch import RolloutBatch
from engine.config import build_config
from engine.models import load_model
from engine.trainer import TorchTrainer
from engine.trainer.actor import (
    LogprobSettings,
    actor_loss,
    global_batch_info,
    mini_batches,
    skips_zero_advantage_rows,
)
from tests.engine.batches import random_batch

ROWS, LENGTH = 12, 6


def _loss_inputs(seed: int) -> dict[str, torch.Tensor]:
    """Float64 inputs: with and without the zero rows the losses sum the same terms in other orders
    (other reduction shapes), which in float64 differ by ~1e-16 of the terms' magnitudes, however the
    CPU vectorises the sums; the tolerances below are 1e-12."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(LENGTH) < torch.randint(1, LENGTH + 1, (ROWS, 1), generator=gen)).double()
    advantages = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(ROWS, LENGTH).clone()
    advantages[::3] = 0.0  # every third row: a group whose completions all scored the same
    old = -torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 3
    return {
        "old_log_prob": old,
        "log_prob": old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64),
        "advantages": advantages * mask,
        "response_mask": mask,
        "rollout_is_weights": 0.5 + torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64),
    }


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(set(POLICY_LOSS_REGISTRY) - ROW_MEAN_LOSSES))
def test_zero_advantage_rows_add_nothing_to_any_policy_loss(name: str, agg: str) -> None:
    inputs = _loss_inputs(seed=7)
    mask = inputs["response_mask"]
    config = PolicyLossConfig(
        loss_agg_mode=agg, loss_scale_factor=float(LENGTH), global_batch_info=global_batch_info(mask, LENGTH)
    )
    live = inputs["advantages"].ne(0).any(-1)
    assert 0 < int(live.sum()) < ROWS
    results = []
    for rows in (torch.arange(ROWS), torch.nonzero(live).flatten()):
        log_prob = inputs["log_prob"][rows].clone().requires_grad_(True)
        args = {k: v[rows] for k, v in inputs.items() if k != "log_prob"}
        loss, _ = POLICY_LOSS_REGISTRY[name](log_prob=log_prob, loss_agg_mode=agg, config=config, **args)
        loss.backward()
        grad = torch.zeros(ROWS, LENGTH, dtype=torch.float64)
        grad[rows] = log_prob.grad
        results.append((loss.detach(), grad))
    (full_loss, full_grad), (live_loss, live_grad) = results
    assert torch.isfinite(full_loss)
    assert full_grad[~live].abs().max() == 0, f"{name}: a zero-advantage row has a gradient"
    torch.testing.assert_close(live_loss, full_loss, rtol=1e-12, atol=1e-14, msg=name)
    torch.testing.assert_close(live_grad, full_grad, rtol=1e-12, atol=1e-14, msg=name)


def _scored_batch(vocab: int) -> RolloutBatch:
    """Six groups of four; groups 0 and 3 all scored the same (zero advantages)."""
    batch = random_batch(vocab, groups=6, n=4, seed=5)
    gen = torch.Generator().manual_seed(11)
    per_group = torch.randn(6, generator=gen)
    per_group[[0, 3]] = 0.0
    group = torch.tensor([int(key[1:]) for key in batch.index.tolist()])
    sign = torch.where(torch.rand(len(batch), generator=gen) < 0.5, -1.0, 1.0)
    advantages = (per_group[group] * sign)[:, None] * batch.response_mask
    return dataclasses.replace(batch, advantages=advantages, old_log_probs=None)


def _gradients(model: torch.nn.Module, cfg, batch: RolloutBatch, skip: bool) -> tuple[dict, int]:
    """Parameter gradients of one mini-batch through the trainer's own loss, and the rows left out."""
    from engine.trainer.torch_backend import policy_loss_config

    model.zero_grad(set_to_none=True)
    settings = LogprobSettings(temperature=1.0)
    order = np.arange(len(batch))
    [(mini, pl_config, skipped)] = list(
        mini_batches(batch, order, 1, policy_loss_config(cfg), skip_zero_advantage=skip)
    )
    loss, _ = actor_loss(model, mini, cfg.algorithm, settings, pl_config)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, skipped


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_skipping_gives_the_whole_mini_batch_gradient(tiny_model_dir, agg: str) -> None:
    # Float64 model: the two gradients sum the same nonzero terms through matmuls of other shapes,
    # whose blocking (CPU- and thread-dependent) moves float64 results by ~1e-16 of the terms.
    model = load_model(tiny_model_dir).double()
    model.train()
    cfg = build_config({"model": {"path": str(tiny_model_dir)}, "algorithm": {"loss_agg_mode": agg}})
    batch = _scored_batch(model.config.vocab_size)
    batch = dataclasses.replace(
        batch, advantages=batch.advantages.double(), response_mask=batch.response_mask.double()
    )
    full, none_skipped = _gradients(model, cfg, batch, skip=False)
    live, skipped = _gradients(model, cfg, batch, skip=True)
    assert (none_skipped, skipped) == (0, 8)
    assert full.keys() == live.keys()
    for name, grad in full.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(live[name], grad, rtol=0, atol=1e-10 * scale + 1e-15, msg=name)


def test_the_trainer_reports_what_it_left_out_and_never_an_empty_step(tiny_model_dir) -> None:
    model = load_model(tiny_model_dir)
    cfg = build_config({"model": {"path": str(tiny_model_dir)}, "trainer": {"micro_batch_size": 8}})
    trainer = TorchTrainer(model, cfg, device=torch.device("cpu"), need_reference=False)
    batch = _scored_batch(model.config.vocab_size)
    batch = dataclasses.replace(batch, rollout_log_probs=torch.zeros_like(batch.response_mask, dtype=torch.float))
    assert trainer.update_policy(batch)["actor/zero_adv_rows_skipped"] == pytest.approx(8 / 24)

    # A batch with no learning signal at all still takes its optimiser step (one row kept), so AdamW's
    # moments and schedule advance exactly as without the skip.
    silent = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))
    steps = trainer.scheduler.last_epoch
    metrics = trainer.update_policy(silent)
    assert metrics["actor/zero_adv_rows_skipped"] == pytest.approx(23 / 24)
    assert trainer.scheduler.last_epoch == steps + 1
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_rows_are_only_skipped_when_no_term_depends_on_them() -> None:
    base = build_config({}).algorithm
    assert skips_zero_advantage_rows(base, True)
    assert not skips_zero_advantage_rows(base, False)
    assert not skips_zero_advantage_rows(base.model_copy(update={"entropy_coeff": 0.01}), True)
    assert not skips_zero_advantage_rows(base.model_copy(update={"use_kl_loss": True}), True)
    for name in ROW_MEAN_LOSSES:  # a mean over the rows given: leaving rows out would change it
        assert not skips_zero_advantage_rows(base.model_copy(update={"policy_loss": name}), True)
