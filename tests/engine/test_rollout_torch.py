"""The torch rollout backend: the backend contract plus exactness against transformers on a tiny model."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from engine.models import load_model, load_tokenizer, make_model
from engine.rollout import SamplingParams, make_rollout_backend
from engine.rollout import torch_backend as tb
from engine.rollout.base import native_bf16
from engine.rollout.torch_backend import TorchRolloutBackend
from tests.engine.rollout_contract import (
    RolloutBackendContract,
    check_finish_reasons,
    check_shapes,
    encode,
    randomized,
)

LOGPROB_ATOL = 1e-5

# Extra EOS ids (through the generation config): about 1 sampled token in 9 ends a sequence, so rows finish at many
# different steps and leave the batch while others continue.
EXTRA_EOS = list(range(200, 260))

MIXED_TEXTS = (
    "hi",
    "Add 3 and 4, then multiply the result by seven.",
    "What is two plus five?",
    "One",
    "Count down from nine to zero, then say the answer twice and stop.",
    "The sum of 12 and 30 is",
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def model(tiny_model_dir):
    return randomized(load_model(tiny_model_dir))


@pytest.fixture
def backend(model, tokenizer):
    backend = TorchRolloutBackend(model, tokenizer)
    yield backend
    backend.close()


@pytest.fixture
def other_model(tiny_model_dir):
    return randomized(load_model(tiny_model_dir), seed=1)


class TestTorchBackendContract(RolloutBackendContract):
    """The backend-agnostic contract (tests/engine/rollout_contract.py) on the torch backend."""


# ----------------------------------------------------------------------------- helpers


def hf_greedy(model, tokenizer, prompts, max_new_tokens, eos_token_id=None):
    """transformers ``generate(do_sample=False)`` on a left-padded batch: (tokens, logprobs) per prompt."""
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    eos_set = set(eos) if isinstance(eos, list) else {eos}
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
    results = []
    for row in range(len(prompts)):
        tokens = out.sequences[row, width:].tolist()
        for i, t in enumerate(tokens):
            if t in eos_set:
                tokens = tokens[: i + 1]
                break
        logprobs = [
            torch.log_softmax(out.logits[step][row].float(), -1)[t].item() for step, t in enumerate(tokens)
        ]
        results.append((tokens, logprobs))
    return results


def full_forward_logprobs(model, prompt, completion, temperature):
    """What the trainer recomputes: log_softmax(logits / T) of the completion tokens, one unpadded sequence."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def with_extra_eos(model, tokenizer, **kwargs) -> TorchRolloutBackend:
    """A backend that also stops on ``EXTRA_EOS`` (read from the generation config at construction)."""
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *EXTRA_EOS]
    return TorchRolloutBackend(model, tokenizer, **kwargs)


def token_ids(groups):
    return [[c.token_ids for c in g.completions] for g in groups]


# ----------------------------------------------------------------------------- exactness


def test_greedy_matches_transformers_generate(model, tokenizer, backend):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=20)
    groups = backend.generate(prompts, params)
    check_shapes(groups, prompts, params)
    for group, (ref_tokens, ref_logprobs) in zip(groups, hf_greedy(model, tokenizer, prompts, 20)):
        for c in group.completions:
            assert c.token_ids == ref_tokens
            assert c.logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)


def test_rows_finishing_at_different_steps_match_transformers(model, tokenizer, backend):
    prompts = encode(tokenizer, MIXED_TEXTS)
    early = with_extra_eos(model, tokenizer)
    groups = early.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=20))
    reference = hf_greedy(model, tokenizer, prompts, 20, eos_token_id=[tokenizer.eos_token_id, *EXTRA_EOS])
    lengths = set()
    for group, (ref_tokens, ref_logprobs) in zip(groups, reference):
        for c in group.completions:
            assert c.token_ids == ref_tokens
            assert c.logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)
            assert c.finish_reason == ("stop" if ref_tokens[-1] in EXTRA_EOS else "length")
            lengths.add(len(c.token_ids))
    assert len(lengths) > 2  # rows really left the batch at different steps


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (0.8, 0, 0.9), (0.5, 50, 0.8)],
)
def test_sampled_logprobs_match_a_full_forward(model, tokenizer, backend, temperature, top_k, top_p):
    prompts = encode(tokenizer, MIXED_TEXTS)
    sampler = with_extra_eos(model, tokenizer)
    params = SamplingParams(
        n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=11
    )
    groups = sampler.generate(prompts, params)
    check_shapes(groups, prompts, params)
    for prompt, group in zip(prompts, groups):
        for c in group.completions:
            expected = full_forward_logprobs(model, prompt, c.token_ids, temperature)
            assert torch.tensor(c.logprobs) == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_left_padding_does_not_change_outputs(tokenizer, backend):
    short, *longer = encode(tokenizer, ("One", *MIXED_TEXTS[1:]))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    alone = backend.generate([short], params)[0].completions[0]
    batched = backend.generate([*longer, short], params)[-1].completions[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=LOGPROB_ATOL)


def test_growing_the_kv_buffers_keeps_outputs(model, tokenizer, backend, monkeypatch):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    monkeypatch.setattr(tb, "_INITIAL_GEN_CAPACITY", 3)
    groups = backend.generate(prompts, params)
    for group, (ref_tokens, _) in zip(groups, hf_greedy(model, tokenizer, prompts, 24)):
        assert group.completions[0].token_ids == ref_tokens


def test_generic_path_matches_fast_path(model, tokenizer, backend):
    prompts = encode(tokenizer, MIXED_TEXTS)
    fast = with_extra_eos(model, tokenizer)
    generic = with_extra_eos(model, tokenizer)
    generic._fast = False  # as for models without transformers' attention interface
    for params in (
        SamplingParams(n=3, temperature=0.0, max_new_tokens=16),
        SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=16, seed=2),
    ):
        a, b = fast.generate(prompts, params), generic.generate(prompts, params)
        assert token_ids(a) == token_ids(b)
        for ga, gb in zip(a, b):
            for ca, cb in zip(ga.completions, gb.completions):
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=LOGPROB_ATOL)
                assert ca.finish_reason == cb.finish_reason


def test_llama_architecture_matches_transformers(tmp_path, tokenizer):
    path = make_model(tmp_path / "tiny-llama", arch="llama", size="tiny", seed=3)
    llama, llama_tokenizer = randomized(load_model(path), seed=3), load_tokenizer(path)
    backend = TorchRolloutBackend(llama, llama_tokenizer)
    prompts = encode(llama_tokenizer, MIXED_TEXTS)
    groups = backend.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    for group, (ref_tokens, ref_logprobs) in zip(groups, hf_greedy(llama, llama_tokenizer, prompts, 12)):
        assert group.completions[0].token_ids == ref_tokens
        assert group.completions[0].logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_seeded_samples_do_not_depend_on_batching(model, tokenizer, backend, max_batch_size):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=3, temperature=1.0, top_k=40, max_new_tokens=12, seed=7)
    whole = with_extra_eos(model, tokenizer).generate(prompts, params)
    chunked_backend = with_extra_eos(model, tokenizer, max_batch_size=max_batch_size)
    chunked = chunked_backend.generate(prompts, params)
    assert chunked_backend.last_stats["chunks"] == -(-len(prompts) * 3 // max_batch_size)
    assert token_ids(chunked) == token_ids(whole)
    for ga, gb in zip(whole, chunked):
        for ca, cb in zip(ga.completions, gb.completions):
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=LOGPROB_ATOL)
            assert (ca.text, ca.finish_reason) == (cb.text, cb.finish_reason)


def test_sampling_leaves_global_rng_and_training_mode_alone(model, tokenizer, backend):
    model.train()
    state = torch.get_rng_state()
    backend.generate(encode(tokenizer), SamplingParams(n=2, temperature=1.0, max_new_tokens=5))
    backend.generate(encode(tokenizer), SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=1))
    assert torch.equal(state, torch.get_rng_state())
    assert model.training
    assert model.config._attn_implementation == "sdpa"
    model.eval()
    backend.generate(encode(tokenizer), SamplingParams(n=1, temperature=0.0, max_new_tokens=2))
    assert not model.training


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (4, 1.0), (0, 0.6)])
def test_samples_follow_the_filtered_distribution(model, tokenizer, backend, top_k, top_p):
    prompt = encode(tokenizer, ["What is two plus five?"])[0]
    temperature = 0.8
    draws = 3000
    groups = backend.generate(
        [prompt],
        SamplingParams(n=draws, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=0),
    )
    counts = Counter(c.token_ids[0] for c in groups[0].completions)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if top_k:
        keep[order[:top_k]] = True
    elif top_p < 1:
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before < top_p]] = True
    else:
        keep[:] = True
    assert set(counts) <= set(keep.nonzero().flatten().tolist()), "sampled a token outside the filter"
    target = torch.where(keep, probs, 0.0)
    target = target / target.sum()
    # every token with an expected count of at least 50: observed within 5 standard deviations
    checked = 0
    for token in order[:50].tolist():
        expected = draws * target[token].item()
        if expected >= 50:
            sd = (expected * (1 - target[token].item())) ** 0.5
            assert abs(counts[token] - expected) < 5 * sd, (token, counts[token], expected)
            checked += 1
    assert checked >= 2


def test_stop_string_on_the_last_token_is_a_stop(tokenizer, backend):
    """A stop string completed by the max_new_tokens-th token ends the completion as "stop", not "length"."""
    for prompt in encode(tokenizer, MIXED_TEXTS):
        for max_new in range(3, 12):
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new)
            free = backend.generate([prompt], params)[0].completions[0]
            text = free.text
            if free.finish_reason != "length" or not text or text.count(text[-1]) > 1:
                continue
            if (
                text[-1].isspace()
                or text[-1] == "\ufffd"
                or text[-1] in tokenizer.decode(free.token_ids[:-1])
            ):
                continue
            stopped = backend.generate([prompt], replace(params, stop=(text[-1],)))[0].completions[0]
            assert (stopped.token_ids, stopped.finish_reason, stopped.text) == (free.token_ids, "stop", text)
            return
    pytest.fail("no greedy completion ends in a character it has not produced before")


def greedy_texts(tokenizer, backend) -> list[tuple[list[int], str]]:
    """``(prompt, greedy completion text)`` of every contract prompt, for the stop-string tests to
    pick a stop string from."""
    prompts = encode(tokenizer)
    free = backend.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
    return [(prompt, group.completions[0].text) for prompt, group in zip(prompts, free)]


def test_earliest_of_several_stop_strings_wins(tokenizer, backend):
    for prompt, text in greedy_texts(tokenizer, backend):
        chars = [ch for ch in dict.fromkeys(text) if not ch.isspace() and ch != "\ufffd"]
        if len(chars) < 2:
            continue
        first, second = chars[0], chars[1]  # first appears before second
        params = SamplingParams(n=2, temperature=0.0, max_new_tokens=16, stop=(second, first, "never-there"))
        c = backend.generate([prompt], params)[0].completions[0]
        assert c.finish_reason == "stop"
        assert c.text == text[: text.index(first) + 1]
        check_finish_reasons(backend.generate([prompt], params), tokenizer, params)
        return
    pytest.fail("no usable greedy text")


def test_stop_string_ending_in_a_space(tokenizer, backend):
    for prompt, text in greedy_texts(tokenizer, backend):
        i = text.find(" ", 1)
        if i <= 0 or "\ufffd" in text[: i + 1]:
            continue
        stop = text[i - 1 : i + 1]
        c = backend.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=16, stop=(stop,)))
        c = c[0].completions[0]
        assert c.finish_reason == "stop"
        assert c.text == text[: text.find(stop) + len(stop)]
        return
    pytest.fail("no greedy text with a space")


# ----------------------------------------------------------------------------- weights


def test_shared_model_update_only_bumps_the_version(model, tokenizer, backend):
    prompts = encode(tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    before = backend.generate(prompts, params)
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with torch.no_grad():  # what an optimizer step does to the shared model
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    backend.update_weights(model.state_dict(), 1)
    assert backend.policy_version == 1
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == pointers
    after = backend.generate(prompts, params)
    assert token_ids(before) != token_ids(after)
    assert all(c.policy_version == 1 for g in after for c in g.completions)


def test_update_from_another_model_reproduces_it(tokenizer, backend, other_model):
    other = other_model
    prompts = encode(tokenizer, MIXED_TEXTS)
    backend.update_weights({k: v.clone() for k, v in other.state_dict().items()}, 4)
    groups = backend.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    for group, (ref_tokens, _) in zip(groups, hf_greedy(other, tokenizer, prompts, 12)):
        assert group.completions[0].token_ids == ref_tokens


@pytest.mark.parametrize("name", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_embeddings_load_through_either_name(model, backend, other_model, name):
    assert model.config.tie_word_embeddings
    other = {k: v.clone() for k, v in other_model.state_dict().items()}
    embedding = other["model.embed_tokens.weight"]
    weights = {k: v for k, v in other.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    weights[name] = embedding
    backend.update_weights(weights, 2)
    assert torch.equal(model.lm_head.weight, embedding)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tied_names_with_different_values_are_rejected(model, backend, policy_weights):
    weights = {k: v + 1.0 for k, v in policy_weights.items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="tied"):
        backend.update_weights(weights, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert backend.policy_version == 0


def test_missing_weights_are_rejected_and_nothing_is_loaded(model, backend, policy_weights):
    weights = {k: v + 1.0 for k, v in policy_weights.items() if k != "model.norm.weight"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        backend.update_weights(weights, 1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert backend.policy_version == 0


# ----------------------------------------------------------------------------- API details


def test_factory_builds_torch_and_lists_known_backends(model, tokenizer):
    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=8, policy_version=3)
    assert isinstance(backend, TorchRolloutBackend)
    assert backend.max_batch_size == 8 and backend.policy_version == 3
    with pytest.raises(ValueError, match="torch"):
        make_rollout_backend("nope", model, tokenizer)


def test_last_stats_count_generated_tokens(tokenizer, backend):
    groups = backend.generate(
        encode(tokenizer), SamplingParams(n=3, temperature=1.0, max_new_tokens=7, seed=0)
    )
    stats = backend.last_stats
    assert stats["gen_tokens"] == sum(len(c.token_ids) for g in groups for c in g.completions)
    assert stats["gen_seconds"] > 0
    assert stats["sequences"] == 12


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1, 2]], SamplingParams(n=0), "n must be"),
        ([[1, 2]], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([[1, 2]], SamplingParams(temperature=-1.0), "temperature"),
        ([[1, 2]], SamplingParams(top_p=0.0), "top_p"),
        ([[1, 2]], SamplingParams(stop=("",)), "stop"),
        ([[]], SamplingParams(), "empty"),
        ([[1, 10**6]], SamplingParams(), "outside"),
    ],
)
def test_bad_inputs_are_rejected(backend, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        backend.generate(prompts, params)


def test_closed_backend_refuses_work(tokenizer, backend):
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.generate(encode(tokenizer), SamplingParams())


def test_model_works_normally_while_switched_to_rollout_attention(model, tokenizer, backend):
    """Another caller of the shared model during a generation (e.g. a trainer thread) gets correct outputs."""
    prompts = encode(tokenizer, MIXED_TEXTS[:3])
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    model.train()
    with torch.no_grad():
        expected = [model(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids[1:2]).logits]
    with backend._generation_mode(), torch.inference_mode(False), torch.no_grad():
        model.train()
        assert model.config._attn_implementation == tb.ATTENTION_NAME
        got = [model(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids[1:2]).logits]
    for e, g in zip(expected, got):
        real = (
            mask.bool()[:, :, None].expand_as(e)
            if e.shape[0] == len(prompts)
            else torch.ones_like(e, dtype=bool)
        )
        assert torch.allclose(e[real], g[real], atol=1e-5)


def test_bfloat16_model_and_deterministic_algorithms(tiny_model_dir, tokenizer):
    model = randomized(load_model(tiny_model_dir, dtype=torch.bfloat16))
    backend = TorchRolloutBackend(model, tokenizer, device="cpu")
    prompts = encode(tokenizer)
    params = SamplingParams(n=2, temperature=0.9, top_k=30, top_p=0.9, max_new_tokens=6, stop=("e",), seed=0)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # what trainer.deterministic switches on
    try:
        groups = backend.generate(prompts, params)
    finally:
        torch.use_deterministic_algorithms(previous)
    check_shapes(groups, prompts, params)
    check_finish_reasons(groups, tokenizer, params)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_reduced_precision_scores_under_bf16_autocast_and_only_on_request(model, tokenizer, backend):
    """With ``scores_in_bf16`` (forced on, so that any CPU runs the path; emulated bf16 is only slower),
    ``reduced_precision`` scores equal a forward under bf16 autocast done by hand, differ from float32's,
    and the next call without the flag is float32 again. The weights stay float32."""
    prompts = encode(tokenizer)
    continuations = encode(tokenizer, ("4", " seven", " world!", " nine eight"))
    full = backend.continuation_logprobs(prompts, continuations, 1.0)
    backend.scores_in_bf16 = True
    reduced = backend.continuation_logprobs(prompts, continuations, 1.0, reduced_precision=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        by_hand = backend.continuation_logprobs(prompts, continuations, 1.0)
    assert reduced == by_hand and reduced != full
    assert backend.continuation_logprobs(prompts, continuations, 1.0) == full
    backend.scores_in_bf16 = False
    assert backend.continuation_logprobs(prompts, continuations, 1.0, reduced_precision=True) == full
    assert next(model.parameters()).dtype == torch.float32


def test_bf16_scoring_is_chosen_for_float32_models_on_devices_with_native_bf16(tiny_model_dir, tokenizer, backend):
    assert backend.scores_in_bf16 == native_bf16(torch.device("cpu"))
    bf16_model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert not TorchRolloutBackend(bf16_model, tokenizer, device="cpu").scores_in_bf16  # nothing to gain
