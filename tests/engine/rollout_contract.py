"""The contract every rollout backend must pass (torch: test_rollout_torch.py, vLLM: test_rollout_vllm.py).

Use it by subclassing :class:`RolloutBackendContract` in a backend's test module and providing
these fixtures (any scope; function scope is simplest):

- ``backend``: a fresh backend (``policy_version == 0``) on a tiny causal LM (e.g. ``tiny_model_dir``);
- ``tokenizer``: that model's tokenizer;
- ``policy_weights``: the model's full state dict (tensors by parameter name, e.g. ``model.state_dict()``
  of a separately loaded copy), used to restore the weights after a test changed them;
- ``eos_weights``: a state dict under which greedy decoding emits the tokenizer's EOS token first
  (for the ``make_model`` models: final norm weight zeroed, so every logit is 0 and argmax picks id 0,
  which is EOS).

Tests that change weights put ``policy_weights`` back (with version 0) before they end, so a backend
fixture of wider scope stays usable. Nothing here depends on how a backend computes: only on what the
protocol in ``engine/rollout/base.py`` promises.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import pytest
import torch

from engine.rollout import Completion, PromptCompletions, RolloutBackend, SamplingParams

PROMPT_TEXTS = (
    "Add 3 and 4.",
    "What is two plus five? Answer:",
    "hello",
    "Count down from nine to zero, then",
)


def encode(tokenizer, texts=PROMPT_TEXTS) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def eos_ids(tokenizer) -> set[int]:
    return {tokenizer.eos_token_id}


def check_shapes(groups: list[PromptCompletions], prompts: list[list[int]], params: SamplingParams) -> None:
    """One group per prompt, in order; ``n`` completions each; per-token logprobs; version ints."""
    assert len(groups) == len(prompts)
    for group, prompt in zip(groups, prompts):
        assert isinstance(group, PromptCompletions)
        assert list(group.prompt_ids) == list(prompt)
        assert len(group.completions) == params.n
        for c in group.completions:
            assert isinstance(c, Completion)
            assert 1 <= len(c.token_ids) <= params.max_new_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert all(isinstance(t, int) for t in c.token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            assert isinstance(c.text, str)
            assert isinstance(c.policy_version, int)


def check_finish_reasons(groups: list[PromptCompletions], tokenizer, params: SamplingParams) -> None:
    """``length`` means max_new_tokens were produced without EOS/stop; ``stop`` means EOS or a stop string ended it."""
    eos = eos_ids(tokenizer)
    for group in groups:
        for c in group.completions:
            if c.finish_reason == "length":
                assert len(c.token_ids) == params.max_new_tokens
                assert c.token_ids[-1] not in eos
                assert not any(s in c.text for s in params.stop)
            else:
                ended_by_eos = c.token_ids[-1] in eos
                ended_by_stop = any(c.text.endswith(s) for s in params.stop)
                assert ended_by_eos or ended_by_stop, c
            assert not any(t in eos for t in c.token_ids[:-1]), "tokens after EOS"


def randomized(model, seed: int = 0, std: float = 0.2):
    """``model`` with its matrices redrawn at ``std``.

    ``make_model``'s initialisation (std 0.02, tied embeddings) makes a tiny model repeat its last prompt
    token forever; larger weights give varied completions and peaked distributions to test against.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, weight in sorted(model.named_parameters()):
            if weight.dim() >= 2:
                weight.copy_(torch.randn(weight.shape, generator=generator) * std)
    return model


@contextmanager
def restored(backend: RolloutBackend, policy_weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
    try:
        yield
    finally:
        backend.update_weights(policy_weights, 0)


class RolloutBackendContract:
    """Behaviour the engine relies on from every rollout backend."""

    def test_implements_the_protocol(self, backend):
        assert isinstance(backend, RolloutBackend)
        assert backend.policy_version == 0

    def test_groups_in_prompt_order_with_n_completions(self, backend, tokenizer):
        prompts = encode(tokenizer)
        params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=0)
        groups = backend.generate(prompts, params)
        check_shapes(groups, prompts, params)
        check_finish_reasons(groups, tokenizer, params)
        assert all(c.policy_version == 0 for g in groups for c in g.completions)

    def test_no_prompts_gives_no_groups(self, backend):
        assert backend.generate([], SamplingParams(n=2)) == []

    def test_length_finish_reason(self, backend, tokenizer):
        prompts = encode(tokenizer)
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=3)
        groups = backend.generate(prompts, params)
        check_shapes(groups, prompts, params)
        check_finish_reasons(groups, tokenizer, params)
        # a random tiny model hardly ever says EOS within 3 greedy tokens
        assert sum(c.finish_reason == "length" for g in groups for c in g.completions) >= len(prompts)

    def test_greedy_is_deterministic_and_n_copies_agree(self, backend, tokenizer):
        prompts = encode(tokenizer)
        params = SamplingParams(n=3, temperature=0.0, max_new_tokens=8)
        first = backend.generate(prompts, params)
        again = backend.generate(prompts, params)
        alone = [backend.generate([p], params)[0] for p in prompts]
        for g1, g2, g3 in zip(first, again, alone):
            ids = [c.token_ids for c in g1.completions]
            assert ids == [ids[0]] * 3
            assert ids == [c.token_ids for c in g2.completions] == [c.token_ids for c in g3.completions]

    def test_top_k_one_is_greedy(self, backend, tokenizer):
        prompts = encode(tokenizer)
        greedy = backend.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
        topk = backend.generate(
            prompts, SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=8, seed=3)
        )
        for g, k in zip(greedy, topk):
            for c in k.completions:
                assert c.token_ids == g.completions[0].token_ids
                # at temperature 1, logprobs (taken before truncation) are the greedy ones
                assert c.logprobs == pytest.approx(g.completions[0].logprobs, abs=1e-4)

    def test_seed_makes_sampling_reproducible(self, backend, tokenizer):
        prompts = encode(tokenizer)
        params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=1234)
        a = backend.generate(prompts, params)
        b = backend.generate(prompts, params)
        assert [[c.token_ids for c in g.completions] for g in a] == [
            [c.token_ids for c in g.completions] for g in b
        ]
        for ga, gb in zip(a, b):
            for ca, cb in zip(ga.completions, gb.completions):
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-6)
                assert ca.text == cb.text and ca.finish_reason == cb.finish_reason
        other = backend.generate(
            prompts, SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=99)
        )
        assert [[c.token_ids for c in g.completions] for g in a] != [
            [c.token_ids for c in g.completions] for g in other
        ]

    def test_samples_of_a_group_differ(self, backend, tokenizer):
        prompts = encode(tokenizer)[:1]
        groups = backend.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=8, seed=5))
        assert len({tuple(c.token_ids) for c in groups[0].completions}) > 1

    def test_unseeded_calls_differ(self, backend, tokenizer):
        prompts = encode(tokenizer)[:1]
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
        a = backend.generate(prompts, params)
        b = backend.generate(prompts, params)
        assert [c.token_ids for c in a[0].completions] != [c.token_ids for c in b[0].completions]

    def test_stop_string_ends_the_completion(self, backend, tokenizer):
        prompts = encode(tokenizer)
        free = backend.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
        for prompt, group in zip(prompts, free):
            ids = group.completions[0].token_ids
            if ids[-1] in eos_ids(tokenizer):
                continue
            full = tokenizer.decode(ids, skip_special_tokens=True)
            # a stop string that ends inside the completion: two characters ending at a mid-completion token
            cut = len(tokenizer.decode(ids[: max(2, len(ids) // 2)], skip_special_tokens=True))
            stop = full[max(0, cut - 2) : cut]
            if not stop.strip() or "\ufffd" in stop:
                continue
            k = next(
                k
                for k in range(1, len(ids) + 1)
                if stop in tokenizer.decode(ids[:k], skip_special_tokens=True)
            )
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16, stop=(stop,))
            got = backend.generate([prompt], params)[0].completions[0]
            assert got.finish_reason == "stop"
            assert got.token_ids == ids[:k]
            assert got.text == full[: full.find(stop) + len(stop)]
            assert got.text.endswith(stop)
            assert len(got.logprobs) == k
            check_finish_reasons([PromptCompletions(prompt, [got])], tokenizer, params)
            return
        pytest.fail("no usable stop string found in the greedy completions")

    def test_eos_ends_the_completion(self, backend, tokenizer, eos_weights, policy_weights):
        prompts = encode(tokenizer)
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=8)
        with restored(backend, policy_weights):
            backend.update_weights(eos_weights, 1)
            groups = backend.generate(prompts, params)
            check_shapes(groups, prompts, params)
            check_finish_reasons(groups, tokenizer, params)
            for g in groups:
                for c in g.completions:
                    assert c.token_ids == [tokenizer.eos_token_id]
                    assert c.finish_reason == "stop"
                    assert c.text == ""  # special tokens are skipped
                    assert c.policy_version == 1

    def test_update_weights_tags_versions(self, backend, tokenizer, policy_weights):
        prompts = encode(tokenizer)
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
        before = backend.generate(prompts, params)
        with restored(backend, policy_weights):
            backend.update_weights(policy_weights, 7)
            assert backend.policy_version == 7
            after = backend.generate(prompts, params)
            assert all(c.policy_version == 7 for g in after for c in g.completions)
            # same weights, same greedy completions
            assert [[c.token_ids for c in g.completions] for g in before] == [
                [c.token_ids for c in g.completions] for g in after
            ]
        assert backend.policy_version == 0

    def test_update_weights_changes_outputs(self, backend, tokenizer, policy_weights):
        prompts = encode(tokenizer)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
        before = backend.generate(prompts, params)
        # a pseudo-random function of the values only, so that tied entries stay equal
        perturbed = {
            k: (v + 0.5 * torch.sin(1000.0 * v + 1.0) if v.is_floating_point() else v)
            for k, v in policy_weights.items()
        }
        with restored(backend, policy_weights):
            backend.update_weights(perturbed, 1)
            after = backend.generate(prompts, params)
            assert [g.completions[0].token_ids for g in before] != [g.completions[0].token_ids for g in after]
        restored_out = backend.generate(prompts, params)
        assert [g.completions[0].token_ids for g in before] == [
            g.completions[0].token_ids for g in restored_out
        ]

    def test_update_weights_rejects_unknown_names(self, backend, policy_weights):
        bad = dict(policy_weights)
        name = next(iter(bad))
        bad["not.a.parameter"] = bad[name]
        with pytest.raises((KeyError, ValueError), match=r"not\.a\.parameter"):
            backend.update_weights(bad, 3)
        assert backend.policy_version == 0

    def test_update_weights_rejects_wrong_shapes(self, backend, policy_weights):
        bad = dict(policy_weights)
        name = next(k for k, v in bad.items() if v.dim() == 2)
        bad[name] = bad[name][:, :-1]
        with pytest.raises(ValueError, match="shape"):
            backend.update_weights(bad, 3)
        assert backend.policy_version == 0

    # -- continuation_logprobs: the answer-likelihood predictor's scorer ----------------------------------

    def test_continuation_logprobs_equal_the_sampling_logprobs(self, backend, tokenizer):
        """Scoring a sampled completion gives the sum of the log-probs it was sampled with, at the same
        temperature: the scorer reads the distribution the sampler draws from (each token's log-prob
        agrees to 1e-4 between decoding and a full forward, so the sums of up to 8 to 8e-4)."""
        prompts = encode(tokenizer)
        for temperature in (1.0, 0.7):
            params = SamplingParams(n=2, temperature=temperature, max_new_tokens=8, seed=3)
            groups = backend.generate(prompts, params)
            pairs = [(g.prompt_ids, c.token_ids, sum(c.logprobs)) for g in groups for c in g.completions]
            scores = backend.continuation_logprobs([p for p, _, _ in pairs], [c for _, c, _ in pairs], temperature)
            assert len(scores) == len(pairs)
            for (_, completion, expected), got in zip(pairs, scores):
                assert got == pytest.approx(expected, abs=1e-4 * len(completion)), completion

    def test_continuation_logprobs_do_not_depend_on_the_batch(self, backend, tokenizer):
        prompts = encode(tokenizer)
        continuations = encode(tokenizer, ("4", " seven", " world!", " nine eight"))
        together = backend.continuation_logprobs(prompts, continuations, 1.0)
        alone = [backend.continuation_logprobs([p], [c], 1.0)[0] for p, c in zip(prompts, continuations)]
        assert together == pytest.approx(alone, abs=1e-4)
        assert all(math.isfinite(s) and s < 0 for s in together)
        # A continuation extends its own first token: its probability can only be smaller.
        assert len(continuations[3]) > 1
        first = backend.continuation_logprobs(prompts[3:], [continuations[3][:1]], 1.0)[0]
        assert together[3] < first

    def test_continuation_logprobs_follow_the_weights(self, backend, tokenizer, policy_weights):
        prompts = encode(tokenizer)
        continuations = encode(tokenizer, ("4", " seven", " world!", " nine eight"))
        before = backend.continuation_logprobs(prompts, continuations, 1.0)
        perturbed = {
            k: (v + 0.5 * torch.sin(1000.0 * v + 1.0) if v.is_floating_point() else v)
            for k, v in policy_weights.items()
        }
        with restored(backend, policy_weights):
            backend.update_weights(perturbed, 1)
            after = backend.continuation_logprobs(prompts, continuations, 1.0)
            assert all(abs(a - b) > 1e-3 for a, b in zip(before, after))
        assert backend.continuation_logprobs(prompts, continuations, 1.0) == pytest.approx(before, abs=1e-5)

    def test_reduced_precision_scores_stay_near_the_full_ones(self, backend, tokenizer):
        """``reduced_precision`` may score in bfloat16 (the torch backend does where the device
        multiplies it natively). bf16 keeps 8 significant bits: a logit of magnitude ~10 is then ~0.02
        off from the rounding of the head's output alone, and the layers below add theirs (measured
        on this model: at most 0.027 a token); 0.1 a token is well past that. The flag holds for its
        own call only."""
        prompts = encode(tokenizer)
        continuations = encode(tokenizer, ("4", " seven", " world!", " nine eight"))
        full = backend.continuation_logprobs(prompts, continuations, 1.0)
        reduced = backend.continuation_logprobs(prompts, continuations, 1.0, reduced_precision=True)
        for continuation, exact, estimate in zip(continuations, full, reduced):
            assert estimate == pytest.approx(exact, abs=0.1 * len(continuation)), continuation
        assert backend.continuation_logprobs(prompts, continuations, 1.0) == full

    def test_continuation_logprobs_refuse_bad_input(self, backend, tokenizer):
        prompts = encode(tokenizer)
        with pytest.raises(ValueError, match="continuation 1 is empty"):
            backend.continuation_logprobs(prompts[:2], [[5], []], 1.0)
        with pytest.raises(ValueError, match="one each"):
            backend.continuation_logprobs(prompts[:2], [[5]], 1.0)
        with pytest.raises(ValueError, match="temperature > 0"):
            backend.continuation_logprobs(prompts[:1], [[5]], 0.0)
        with pytest.raises(ValueError, match="outside"):
            backend.continuation_logprobs(prompts[:1], [[10**9]], 1.0)
        assert backend.continuation_logprobs([], [], 1.0) == []
