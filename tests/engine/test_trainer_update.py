"""The trainer's update does only the arithmetic it needs (issue 19), and stays the same computation.

* ``response_logprobs`` leaves the last response column out of the forward passes (it predicts no
  token and, attention being causal, no position reads it): its log-probs and gradients must still be
  the model's own, ``log_softmax(model(prompt + response).logits / T)`` at each response token.
* ``collate`` fills each tensor with one vectorised assignment: every token, log-prob, mask bit and
  reward must land where the row-by-row layout puts it.
* The torch trainer steps a fused AdamW: the same update as the plain one, to float rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.batch import Rollout, RolloutBatch, collate
from engine.config import build_config
from engine.data import Prompt
from engine.models import load_model
from engine.rollout import Completion
from engine.trainer import TorchTrainer, actor
from engine.trainer.actor import LogprobSettings, response_logprobs
from engine.trainer.schedule import optimizer_and_schedule
from tests.engine.batches import random_batch


def model_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """The reference: the whole causal LM over every prompt + response token, full logits, log-softmax,
    each response token's log-prob read at the position before it (zero where masked)."""
    attn = batch.attention_mask
    logits = model(
        input_ids=batch.input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)
    ).logits
    p, r = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p - 1 + r].float() / temperature, dim=-1)
    return logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) * batch.response_mask


def one_token_batch(vocab: int) -> RolloutBatch:
    """Every response one token long (R = 1): no response column is run at all."""
    rows = []
    for g, prompt_ids in enumerate(([5, 6, 7], [8, 9], [10, 11, 12, 13])):
        prompt = Prompt(uid=f"p{g}", text="", raw="")
        for token in (3, vocab - 1):
            rows.append(
                Rollout(prompt, prompt_ids, Completion([token], [-1.0], "", "stop", 0), 0.0, {}, f"g{g}")
            )
    return collate(rows, pad_id=0, policy_version=0)


@pytest.mark.parametrize("path", ["full", "two-pass", "packed"])
@pytest.mark.parametrize("case", ["ragged", "one-token"])
def test_response_logprobs_are_the_models_own(tiny_model_dir, monkeypatch, path: str, case: str) -> None:
    model = load_model(tiny_model_dir)
    model.train()
    vocab = model.config.vocab_size
    batch = random_batch(vocab, groups=4, n=3, seed=2) if case == "ragged" else one_token_batch(vocab)
    assert batch.response_mask[:, -1].any(), "some row must fill the last column, or nothing is tested"
    if case == "ragged":  # a trained token after an untrained one, as a truncated row can leave
        batch.response_mask[0, 0] = 0.0
    if path == "two-pass":  # the path of groups too long to pack
        monkeypatch.setattr(actor, "PACKED_MAX_TOKENS", 0)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(3))
    grads, passes = [], []
    trunk, _ = actor.split_model(model)
    hook = trunk.register_forward_pre_hook(lambda _m, _a, kw: passes.append(len(kw["input_ids"])), with_kwargs=True)
    for compute in ("reference", "trainer"):
        model.zero_grad()
        if compute == "reference":
            lp = model_logprobs(model, batch, temperature=0.7)
            passes.clear()
        else:
            settings = LogprobSettings(temperature=0.7, shared_prompt=path != "full")
            lp, _ = response_logprobs(model, batch, settings, compute_entropy=False)
        (lp * weights * batch.response_mask).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    hook.remove()
    # The trunk's passes (the rows of each) say which path ran: a second pass of the two-pass path
    # runs the responses (none when every response is one token long).
    rows, groups = len(batch), len(set(batch.index))
    expected = {"full": [rows], "two-pass": [groups, rows] if case == "ragged" else [groups], "packed": [groups]}
    assert passes == expected[path]
    (ref_lp, ref_g), (lp, g) = grads
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    for name in ref_g:
        torch.testing.assert_close(g[name], ref_g[name], atol=1e-5, rtol=1e-4, msg=name)


def test_collate_places_every_token_where_the_row_layout_does() -> None:
    prompt = Prompt(uid="p", text="", raw="")
    specs = [  # (prompt ids, response ids, log-probs, reward)
        ([4, 5, 6], [7, 8], [-0.5, -1.25], 1.0),
        ([9], [10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4], 0.25),
        ([14, 15], [], [], 0.75),  # an empty completion: no token, no reward position
        ([16, 17, 18, 19], [20], [-2.0], -1.0),
    ]
    rows = [
        Rollout(prompt, p, Completion(r, lp, "", "stop", 0), reward, {}, f"g{i % 2}")
        for i, (p, r, lp, reward) in enumerate(specs)
    ]
    batch = collate(rows, pad_id=2, policy_version=7)
    assert batch.prompt_ids.dtype == batch.prompt_mask.dtype == batch.response_ids.dtype == torch.long
    assert batch.response_mask.dtype == batch.rollout_log_probs.dtype == torch.float32
    assert batch.prompt_ids.tolist() == [[2, 4, 5, 6], [2, 2, 2, 9], [2, 2, 14, 15], [16, 17, 18, 19]]
    assert batch.prompt_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch.response_ids.tolist() == [[7, 8, 2, 2], [10, 11, 12, 13], [2, 2, 2, 2], [20, 2, 2, 2]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    expected_lp = torch.tensor([[-0.5, -1.25, 0, 0], [-0.1, -0.2, -0.3, -0.4], [0] * 4, [-2.0, 0, 0, 0]])
    assert torch.equal(batch.rollout_log_probs, expected_lp)
    assert batch.token_level_scores.tolist() == [[0, 1.0, 0, 0], [0, 0, 0, 0.25], [0] * 4, [-1.0, 0, 0, 0]]
    assert list(batch.index) == ["g0", "g1", "g0", "g1"] and batch.rows == rows and batch.policy_version == 7
    assert batch.attention_mask.tolist() == [
        [0, 1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert collate(rows[2:3], pad_id=2, policy_version=0).response_ids.shape == (1, 1)  # R is at least 1


def test_the_torch_trainer_steps_a_fused_adamw_equal_to_the_plain_one(tiny_model_dir) -> None:
    cfg = build_config(
        {"trainer": {"device": "cpu", "total_steps": 3}, "optimizer": {"lr": 1e-2, "weight_decay": 0.1}}
    )
    trainer = TorchTrainer(load_model(tiny_model_dir), cfg, device=torch.device("cpu"), need_reference=False)
    assert trainer.optimizer.defaults["fused"] is True
    plain_model = copy.deepcopy(trainer.model)
    plain, _ = optimizer_and_schedule(plain_model, cfg)
    assert not plain.defaults["fused"]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(trainer.model.parameters(), plain_model.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        trainer.optimizer.step()
        plain.step()
    for (name, p), q in zip(trainer.model.named_parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
