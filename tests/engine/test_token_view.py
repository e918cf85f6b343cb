"""The samples' token view (``extra.tokens``, engine/pipeline/token_view.py): each token's text as the
tokenizer split it, the log-probability it was sampled with and the entropy of its distribution, equal
to what the policy itself computes; bounded per sample and per step; in sync and async runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from engine.batch import Rollout
from engine.config import build_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data import Prompt
from engine.models import load_model
from engine.pipeline.metrics import TOKEN_BYTES_PER_STEP, sample_items
from engine.pipeline.token_view import token_texts
from engine.rollout import SamplingParams
from engine.rollout.torch_backend import TorchRolloutBackend
from engine.rollout.vllm_backend import entropy_lower_bound
from engine.run import execute
from tests.engine.rollout_contract import encode, randomized
from tests.engine.test_run import read_events, small_config

TEXTS = ("Add 3 and 4, then multiply by seven.", "What is two plus five?", "Count down from nine:")
TEMPERATURE = 0.8
# A value in the event is the backend's float32 number rounded to 3 decimals (error <= 5e-4). The
# recomputation below runs the whole sequence through the model at once instead of token by token with
# a KV cache: the same float32 operations in another order. On this model (logits of magnitude < 30,
# a 64-wide hidden state, a vocabulary of a few hundred) the reorderings move a log-softmax by well under
# 1e-5 (30 * 2**-24 per rounding, tens of roundings); 1e-4 leaves a 10x margin over that.
TOLERANCE = 5e-4 + 1e-4


def rollouts(groups, prompts, texts) -> list[Rollout]:
    rows = []
    for g, (ids, text) in enumerate(zip(prompts, texts)):
        prompt = Prompt(uid=f"p{g}", text=text, raw=text, token_ids=ids)
        for c in groups[g].completions:
            rows.append(Rollout(prompt, ids, c, reward=0.0, components={}, group=f"g{g}"))
    return rows


def recomputed(model, prompt_ids: list[int], token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's own log-probs of ``token_ids`` after ``prompt_ids`` at TEMPERATURE, and the entropy
    of each position's distribution: one forward pass over the whole sequence."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)
    return chosen, -(logp.exp() * logp).sum(-1)


@pytest.fixture
def generated(tiny_model_dir, tokenizer):
    model = randomized(load_model(tiny_model_dir))
    backend = TorchRolloutBackend(model, tokenizer)
    prompts = encode(tokenizer, TEXTS)
    # top-k on: the recorded values are those of the untruncated distribution at the temperature.
    params = SamplingParams(n=3, temperature=TEMPERATURE, top_k=20, max_new_tokens=24, seed=7, entropies=True)
    groups = backend.generate(prompts, params)
    # Not asked for (evaluation, no token view): none computed, the same tokens drawn.
    plain = backend.generate(prompts, dataclasses.replace(params, entropies=False))
    assert all(c.entropies is None for g in plain for c in g.completions)
    assert [c.token_ids for g in plain for c in g.completions] == [
        c.token_ids for g in groups for c in g.completions
    ]
    yield model, prompts, rollouts(groups, prompts, TEXTS)
    backend.close()


def test_tokens_carry_the_policy_own_logprobs_and_entropies(generated, tokenizer) -> None:
    model, _, rows = generated
    items = sample_items(
        rows, 100, token_texts=token_texts(tokenizer), token_samples=100, tokens_per_sample=4096
    )
    assert len(items) == len(rows) == 9
    checked = 0
    for row, item in zip(rows, items):
        tokens = item["extra"]["tokens"]
        ids = row.completion.token_ids
        assert (
            tokens["count"]
            == len(ids)
            == len(tokens["text"])
            == len(tokens["logprob"])
            == len(tokens["entropy"])
        )
        logprobs, entropies = recomputed(model, row.prompt_ids, ids)
        assert torch.tensor(tokens["logprob"]) == pytest.approx(logprobs, abs=TOLERANCE)
        assert torch.tensor(tokens["entropy"]) == pytest.approx(entropies, abs=TOLERANCE)
        assert all(round(x, 3) == x for x in tokens["logprob"] + tokens["entropy"])
        # The tokens as the tokenizer split them: joined, they are the decoded completion (its EOS included).
        assert "".join(tokens["text"]) == tokenizer.decode(ids, skip_special_tokens=False)
        checked += len(ids)
    assert checked > 50


def test_caps_bound_samples_tokens_and_bytes(generated, tokenizer) -> None:
    _, _, rows = generated
    items = sample_items(rows, 7, token_texts=token_texts(tokenizer), token_samples=4, tokens_per_sample=5)
    assert len(items) == 7
    assert ["tokens" in item["extra"] for item in items] == [True] * 4 + [False] * 3
    for row, item in zip(rows, items[:4]):
        tokens = item["extra"]["tokens"]
        assert (
            len(tokens["text"]) == len(tokens["logprob"]) == len(tokens["entropy"]) == min(5, tokens["count"])
        )
        assert tokens["count"] == len(row.completion.token_ids)
    # Without a token text function (or with no token samples) nothing is added.
    assert all(
        "tokens" not in i["extra"] for i in sample_items(rows, 7, token_samples=4, tokens_per_sample=5)
    )


def test_the_byte_budget_holds_whatever_the_caps(generated, tokenizer, monkeypatch) -> None:
    _, _, rows = generated
    one = sample_items(
        rows[:1], 1, token_texts=token_texts(tokenizer), token_samples=1, tokens_per_sample=4096
    )
    size = len(json.dumps(one[0]["extra"]["tokens"], ensure_ascii=False).encode())
    monkeypatch.setattr("engine.pipeline.metrics.TOKEN_BYTES_PER_STEP", int(2.5 * size))
    items = sample_items(rows, 9, token_texts=token_texts(tokenizer), token_samples=9, tokens_per_sample=4096)
    carried = [i for i in items if "tokens" in i["extra"]]
    total = sum(len(json.dumps(i["extra"]["tokens"], ensure_ascii=False).encode()) for i in carried)
    assert 1 <= len(carried) < 9 and total <= 2.5 * size
    assert TOKEN_BYTES_PER_STEP <= 4 * 1024 * 1024 // 2


def test_sentencepiece_and_byte_level_pieces_become_text() -> None:
    class SentencePiece:
        all_special_ids = (2,)
        pieces: ClassVar = {5: "\u2581Hello", 6: "<0x0A>", 7: "\u2581w", 8: "orld", 2: "</s>"}

        def convert_ids_to_tokens(self, ids):
            return [self.pieces[i] for i in ids]

    assert token_texts(SentencePiece())([5, 6, 7, 8, 2]) == [" Hello", "\n", " w", "orld", "</s>"]


def test_a_character_split_across_byte_tokens_shows_on_the_token_that_completes_it(tokenizer) -> None:
    ids = tokenizer("é€ ok", add_special_tokens=False)["input_ids"]
    texts = token_texts(tokenizer)(ids)
    assert "".join(texts) == "é€ ok" and "\ufffd" not in "".join(texts)


@pytest.mark.parametrize(
    "asynchronous",
    [None, {"max_staleness": 1}, {"max_staleness": 1, "partial_rollouts": True, "partial_chunk_tokens": 2}],
    ids=["sync", "async", "async-partial"],
)
def test_runs_send_tokens_within_the_caps(
    asynchronous: dict | None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=2, eval_every=0)
    raw["logging"].update(samples_per_step=6, token_samples_per_step=3, tokens_per_sample=4)
    raw["checkpoint"] = {"every_steps": 0, "save_final": False}
    if asynchronous:
        raw["async"] = (
            asynchronous  # partial rollouts: completions assembled from chunks keep their entropies
        )
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    events = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["type"] == "samples"]
    assert [e["step"] for e in events] == [1, 2]
    for event in events:
        assert len(event["items"]) == 6
        with_tokens = [i["extra"]["tokens"] for i in event["items"] if "tokens" in i["extra"]]
        assert len(with_tokens) == 3
        for tokens, item in zip(with_tokens, event["items"]):
            assert tokens["count"] == item["length"] and len(tokens["text"]) == min(4, item["length"])
            assert len(tokens["logprob"]) == len(tokens["entropy"]) == len(tokens["text"])
            assert all(lp <= 0 for lp in tokens["logprob"]) and all(h >= 0 for h in tokens["entropy"])


def test_the_top_k_entropy_bound_is_a_lower_bound_exact_when_k_covers_the_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 5.0):
        logits = torch.randn(50, 300, generator=generator, dtype=torch.float64) * scale
        logp = torch.log_softmax(logits, -1)
        exact = -(logp.exp() * logp).sum(-1)
        for row, h in zip(logp.tolist(), exact.tolist()):
            assert entropy_lower_bound(row, 300) == pytest.approx(h, abs=1e-9)
            bounds = [entropy_lower_bound(row, k) for k in (1, 5, 20, 100)]
            assert all(b <= h + 1e-12 for b in bounds)
            assert bounds == sorted(bounds)  # more of the distribution known, a tighter bound
