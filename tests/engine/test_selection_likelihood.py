"""``data.selection_options.predictor: answer_likelihood``: the policy's chance of writing the reference
answer as the pass-rate prior (engine/data/likelihood.py).

The scorer is checked on a real model and the real torch backend. The pool's mechanics and the
targeting are checked on the synthetic population of test_selection.py through
:class:`CalibratedPolicy`, a stand-in for a policy whose answer likelihood is exactly the prompt's
true pass rate (what the module's measurements found the starter's to be, up to a correlation of
0.8): it is a simulated population, as the outcomes there are, not a stand-in for the backend,
whose own scoring is tested below and in rollout_contract.py. Whole runs use the tiny model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ConfigError, SelectionOptions, build_config, load_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data import Prompt, PromptSelector
from engine.data.likelihood import Q_FLOOR, AnswerScorer, CandidatePool, reference_completion
from engine.models import load_model, load_tokenizer
from engine.rollout import make_rollout_backend
from engine.run import execute
from tests.engine.rollout_contract import randomized
from tests.engine.test_run import metrics_by_step, read_events, small_config
from tests.engine.test_selection import PASS_RATES, deterministic, one_torch_thread, outcome, population

__all__ = ["one_torch_thread"]  # the autouse fixture, imported to apply here too


class CalibratedPolicy:
    """A simulated policy for the selector: it writes each prompt's answer with the prompt's true pass
    rate (the class in its uid, ``PASS_RATES``), and counts what it is asked to score."""

    def __init__(self, prompts: list[Prompt]) -> None:
        self.rate = {tuple(p.token_ids): PASS_RATES[p.uid.split("-")[0]] for p in prompts}
        self.policy_version = 0
        self.calls: list[int] = []

    def continuation_logprobs(self, prompts, continuations, temperature=1.0, *, reduced_precision=False):
        self.calls.append(len(prompts))
        return [math.log(self.rate[tuple(p)]) for p in prompts]


class Words:
    """The least a tokenizer must do for ``AnswerScorer``: ids of texts, and an EOS id."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[1 + ord(ch) % 50 for ch in t] for t in texts]}


def answered(per_class: int) -> list[Prompt]:
    """``population`` with token ids (its index) and an answer, as loaded prompts have."""
    return [
        Prompt(uid=p.uid, text=p.text, raw=p.raw, answer="7", token_ids=[1 + i % 50, 2 + i // 50])
        for i, p in enumerate(population(per_class))
    ]


def likelihood_selector(prompts, *, pool=32, max_age=4, explore=0.1, seed=0, max_per_pick=32.0):
    options = SelectionOptions(
        predictor="answer_likelihood",
        pool=pool,
        likelihood_max_age=max_age,
        explore=explore,
        likelihood_candidates_per_pick=2.0,
        likelihood_max_candidates_per_pick=max_per_pick,
    )
    selector = PromptSelector(prompts, selection="difficulty_targeted", options=options, seed=seed, group_size=4)
    policy = CalibratedPolicy(prompts)
    selector.attach_scorer(AnswerScorer(policy, Words(), temperature=1.0))
    return selector, policy


# ----------------------------------------------------------------------------- the scorer, on a real model


def test_the_scorer_reads_the_policy_chance_of_the_reference_completion(tiny_model_dir: Path) -> None:
    """q = exp(log P(reference completion + EOS | prompt)) at the rollout temperature, from the real
    backend; a prompt without an answer gets NaN and costs no forward; built-in task prompts are
    scored on the task's reference completion."""
    model, tokenizer = randomized(load_model(tiny_model_dir), std=0.5), load_tokenizer(tiny_model_dir)
    backend = make_rollout_backend("torch", model, tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [
        Prompt(uid="a", text="3+4=", raw="3+4=", answer="7", token_ids=encode("3+4=")),
        Prompt(uid="b", text="no answer", raw="no answer", answer=None, token_ids=encode("no answer")),
        Prompt(
            uid="c",
            text="12+30=",
            raw="12+30=",
            answer="42",
            metadata={"task": "arithmetic", "difficulty": 1},
            token_ids=encode("12+30="),
        ),
    ]
    assert reference_completion(prompts[2]) == "42" and reference_completion(prompts[1]) is None
    scorer = AnswerScorer(backend, tokenizer, temperature=0.7)
    q = scorer(prompts)
    eos = tokenizer.eos_token_id
    expected = backend.continuation_logprobs(
        [prompts[0].token_ids, prompts[2].token_ids], [[*encode("7"), eos], [*encode("42"), eos]], 0.7
    )
    assert q[[0, 2]] == pytest.approx(np.clip(np.exp(expected), Q_FLOOR, 1 - Q_FLOOR), rel=1e-6)
    assert math.isnan(q[1])
    assert q[0] > Q_FLOOR  # a real chance, not the floor: the check above compared the model's figures
    assert AnswerScorer(backend, tokenizer, temperature=0.0).temperature == 1.0  # greedy rollouts: T = 1

    # likelihood_precision: auto (the default) asks the backend for its bf16 scores, full for its own
    # (bf16 forced on, so that the two differ on any CPU)
    backend.scores_in_bf16 = True
    answered = [prompts[0].token_ids, prompts[2].token_ids], [[*encode("7"), eos], [*encode("42"), eos]]
    for precision, reduced in (("auto", True), ("full", False)):
        cfg = build_config(
            {"rollout": {"temperature": 0.7}, "data": {"selection_options": {"likelihood_precision": precision}}}
        )
        expected = backend.continuation_logprobs(*answered, 0.7, reduced_precision=reduced)
        q = AnswerScorer.for_run(backend, tokenizer, cfg)(prompts)
        assert q[[0, 2]] == pytest.approx(np.clip(np.exp(expected), Q_FLOOR, 1 - Q_FLOOR), rel=1e-6)
    assert backend.continuation_logprobs(*answered, 0.7, reduced_precision=True) != backend.continuation_logprobs(
        *answered, 0.7
    )
    assert build_config({}).data.selection_options.likelihood_precision == "auto"


# ----------------------------------------------------------------------------- the pool and the targeting


def test_likelihood_targeting_picks_the_prompts_near_one_half() -> None:
    """On a calibrated policy the weighted picks are nearly all of the 0.5 class from the first draw
    (the neighbours' kernel needs measurements first): P0 is 0.02 there against 0.89 for the 0.97
    and 0.03 classes under Beta(20 q, 20 (1 - q)), so exp(-P0 / 0.05) is 1.5e7 times larger."""
    prompts = answered(60)
    selector, _ = likelihood_selector(prompts, pool=60)
    rng = np.random.default_rng(0)
    picked = []
    for step in range(1, 21):
        batch = selector.next_batch(10)
        picked += [p.uid.split("-")[0] for p in batch[1:]]  # the first prompt is the exploration floor's
        for p in batch:
            selector.observe(p.uid, outcome(rng, p, 4), step)
        metrics = selector.metrics()
        assert metrics["selection/scored_prompts"] >= 1
    assert picked.count("mid") / len(picked) > 0.95, picked


def test_the_pool_keeps_the_best_leftovers_for_later_draws() -> None:
    """A draw scores the explored prompt and c / (1 - P0) fresh prompts per pick, P0 the mean predicted
    chance of a zero-variance group of the last fresh candidates (1/2 before any: 2 / 0.5 = 4 a pick;
    on this population 0.97^4 + 0.03^4 = 0.885 for two thirds of the prompts and 1/8 for the rest
    under their Beta(20 q, 20 (1 - q)) predictives, 0.63 in all, so ~5.4 a pick after); the
    candidates it did not pick wait for later draws, the best ``pool`` of them, for at most max_age
    versions: the pool never exceeds its size, holds no stale score, and keeps the prompts near 1/2
    that the picks did not need rather than the others."""
    prompts = answered(100)
    selector, policy = likelihood_selector(prompts, pool=24, max_age=2)
    rng = np.random.default_rng(0)
    for step in range(1, 13):
        policy.policy_version = step // 3
        expected = 1 + math.ceil(7 * 2.0 / (1 - selector.uniform_zero_var) - 1e-9)
        batch = selector.next_batch(8)
        assert policy.calls[-1] == expected  # the explored prompt and the fresh candidates
        assert len(selector.candidates) <= 24
        assert all(policy.policy_version - v <= 2 for v in selector.candidates.versions)
        assert not {p.uid for p in batch[1:]} & {prompts[i].uid for i in selector.candidates.positions}
        for p in batch:
            selector.observe(p.uid, outcome(rng, p, 4), step)
    assert policy.calls[0] == 1 + 4 * 7
    assert np.mean(policy.calls[1:]) > 1 + 4 * 7  # two thirds of the prompts have P0 ~0.88: more than 1/2
    kinds = [prompts[i].uid.split("-")[0] for i in selector.candidates.positions]
    # ~38 fresh prompts a draw hold ~12.7 of the 0.5 class, the picks take 7: the surplus stays (a
    # uniform pool would hold a third of them).
    assert len(kinds) == 24 and kinds.count("mid") >= 16, kinds
    policy.policy_version += 3  # every candidate expires: the next draw starts from fresh ones alone
    selector.next_batch(8)
    assert all(v == policy.policy_version for v in selector.candidates.versions)


def test_the_fresh_candidates_a_pick_stop_at_the_cap() -> None:
    """``likelihood_max_candidates_per_pick`` bounds c / (1 - P0): here 4 a pick at the first draw and
    ~5.4 after (the test above) without it, 3 a pick at every draw with a cap of 3; a cap above the
    count changes nothing."""
    prompts = answered(100)
    rng = np.random.default_rng(0)
    capped, policy = likelihood_selector(prompts, max_per_pick=3.0)
    loose, loose_policy = likelihood_selector(prompts, max_per_pick=6.0)
    for step in range(1, 7):
        for selector in (capped, loose):
            for p in selector.next_batch(8):
                selector.observe(p.uid, outcome(rng, p, 4), step)
    assert policy.calls == [1 + 7 * 3] * 6
    assert loose_policy.calls[0] == 1 + 7 * 4 and max(loose_policy.calls[1:]) > 1 + 7 * 4


def test_the_pool_keeps_the_leftovers_of_highest_weight() -> None:
    pool = CandidatePool()
    pool.add([10, 11, 12, 13, 14], 0, np.array([0.1, 0.5, 0.9, 0.5, 0.2]))
    pool.keep_best(np.array([0.0, 3.0, 1.0, 2.0, 5.0]), picked={4}, size=2)  # row 4 is in the batch
    assert (pool.positions, pool.scores) == ([11, 13], [0.5, 0.5])


def test_no_scorer_is_a_clear_error() -> None:
    options = SelectionOptions(predictor="answer_likelihood")
    selector = PromptSelector(answered(3), selection="difficulty_targeted", options=options)
    with pytest.raises(RuntimeError, match="answer_likelihood' needs the policy's scorer"):
        selector.next_batch(2)


def test_a_restored_pool_draws_what_the_original_draws() -> None:
    """The pool round-trips through JSON (as state.json holds it): the resumed selector draws the same
    prompts and asks the policy to score the same number of them."""
    prompts = answered(40)
    straight, policy = likelihood_selector(prompts, pool=24, max_age=3, seed=4)
    rng = np.random.default_rng(1)
    drawn, calls, saved = [], [], None
    for step in range(1, 13):
        policy.policy_version = step // 2
        if step == 7:
            saved = json.loads(json.dumps(straight.state_dict()))
            calls_before = len(policy.calls)
        batch = straight.next_batch(6)
        drawn.append([p.uid for p in batch])
        for p in batch:
            straight.observe(p.uid, outcome(rng, p, 4), step)
    calls = policy.calls[calls_before:]
    assert saved["selection"]["candidates"]["uids"]
    resumed, again = likelihood_selector(prompts, pool=24, max_age=3, seed=4)
    resumed.load_state_dict(saved)
    rng = np.random.default_rng(1)
    for step in range(1, 7):
        for _ in drawn[step - 1]:
            rng.random(4)
    for step in range(7, 13):
        again.policy_version = step // 2
        batch = resumed.next_batch(6)
        assert [p.uid for p in batch] == drawn[step - 1], step
        for p in batch:
            resumed.observe(p.uid, outcome(rng, p, 4), step)
    assert again.calls == calls
    assert resumed.state_dict() == straight.state_dict()


def test_a_saved_pool_keeps_unscored_candidates_and_drops_unknown_prompts() -> None:
    pool = CandidatePool()
    pool.add([0, 2], 3, np.array([0.25, np.nan]))
    state = json.loads(json.dumps(pool.state_dict([Prompt(uid=u, text=u, raw=u) for u in "abc"])))
    assert state == {"uids": ["a", "c"], "versions": [3, 3], "scores": [0.25, None]}
    back = CandidatePool.from_state(state, {"c": 0, "d": 1})
    assert back.positions == [0] and back.versions == [3] and math.isnan(back.scores[0])


@settings(max_examples=30, deadline=None)
@given(
    per_class=st.integers(1, 10),
    k=st.integers(1, 12),
    explore=st.floats(0.01, 1.0),
    pool=st.integers(1, 40),
    max_age=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_likelihood_selection_stays_in_bounds_and_starves_no_prompt(
    per_class: int, k: int, explore: float, pool: int, max_age: int, seed: int
) -> None:
    """Whatever the sizes: every batch has k of the run's prompts, the pool never exceeds its size nor
    holds a prompt twice, and the exploration floor draws every prompt at least once in any
    ceil((2N - 1) / m) consecutive batches (engine/data/selection.py)."""
    prompts = answered(per_class)
    n = len(prompts)
    selector, policy = likelihood_selector(prompts, pool=pool, max_age=max_age, explore=explore, seed=seed)
    from engine.data.selection import explore_count

    m = explore_count(k, explore)
    window = math.ceil((2 * n - 1) / m)
    rng = np.random.default_rng(seed)
    drawn = []
    for step in range(1, 2 * window + 1):
        policy.policy_version = step // 2
        batch = selector.next_batch(k)
        assert len(batch) == k and {p.uid for p in batch} <= {p.uid for p in prompts}
        positions = selector.candidates.positions
        assert len(positions) <= max(pool, k) and len(set(positions)) == len(positions)
        drawn.append({p.uid for p in batch})
        for p in batch:
            selector.observe(p.uid, outcome(rng, p, 4), step)
        metrics = selector.metrics()
        assert 0.0 < metrics["selection/p_est_mean"] < 1.0
    for start in range(len(drawn) - window + 1):
        assert set().union(*drawn[start : start + window]) == {p.uid for p in prompts}


def test_likelihood_config() -> None:
    cfg = load_config("dapo", ["data.selection=difficulty_targeted", "data.selection_options.predictor=answer_likelihood"])
    assert cfg.data.selection_options.likelihood_strength == 20.0
    assert cfg.data.scores_answers and not load_config("dapo", ["data.selection_options.predictor=answer_likelihood"]).data.scores_answers
    # Unbounded, these overflowed a draw: c k / (1 - P0) past 1.8e308 is inf (math.ceil raises), and an
    # infinite strength made every prior Beta(inf, inf) (NaN weights).
    for field, value in (
        ("likelihood_candidates_per_pick", "1e308"),
        ("likelihood_strength", "inf"),
        ("likelihood_max_candidates_per_pick", "inf"),
    ):
        with pytest.raises(ConfigError, match=rf"data.selection_options.{field}: Input should be less than or equal"):
            load_config("dapo", [f"data.selection_options.{field}={value}"])
    with pytest.raises(ConfigError, match=r"data.selection_options.predictor: Input should be 'neighbours' or"):
        load_config("dapo", ["data.selection_options.predictor=embedding"])
    with pytest.raises(ConfigError, match=r"data.fields.answer is unset; name the answer column"):
        load_config(
            "dapo",
            [
                "data.selection=difficulty_targeted",
                "data.selection_options.predictor=answer_likelihood",
                "data.source=jsonl",
                "data.path=x.jsonl",
                "data.fields.answer=null",
            ],
        )


# ----------------------------------------------------------------------------- whole runs


def likelihood_run(tiny_model_dir: Path, out: Path, **overrides) -> dict:
    raw = small_config(tiny_model_dir, out, total_steps=4, **overrides)
    raw["data"].update(
        {
            "selection": "difficulty_targeted",
            "selection_options": {
                "predictor": "answer_likelihood",
                "pool": 16,
                "explore": 0.25,
                "likelihood_max_age": 1,
                "likelihood_candidates_per_pick": 2.0,
            },
        }
    )
    return raw


def test_resume_with_likelihood_selection_makes_the_same_choices(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real run scores its candidates with its own policy (selection/scored_prompts: the explored
    prompt and c / (1 - P0) fresh prompts for each of the 3 picks, 4 at the first draw); resumed from the step-2 checkpoint, steps 3-4 draw what the straight
    run drew, from the same saved pool, and end with the same selection state."""
    raw = likelihood_run(tiny_model_dir, tmp_path / "a")
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    straight = deterministic(metrics_by_step(events))
    assert straight[1]["selection/scored_prompts"] == 1 + 4 * 3
    assert all(1 + 3 <= straight[s]["selection/scored_prompts"] <= 1 + 16 * 2 * 3 for s in (2, 3, 4))
    checkpoints = [Path(e["path"]) for e in events if e["type"] == "checkpoint"]
    saved = json.loads((checkpoints[0] / "state.json").read_text())["sampler"]["selection"]
    assert 0 < len(saved["candidates"]["uids"]) <= 16  # the leftovers of step 2's draw (and step 1's)
    raw["output_dir"] = str(tmp_path / "b")
    assert execute(build_config(raw), resume=str(checkpoints[0])) == EXIT_SUCCEEDED
    resumed_events = read_events(tmp_path / "b" / "events.jsonl")
    resumed = deterministic(metrics_by_step(resumed_events))

    def prompts_of(evs: list[dict], step: int) -> list[str]:
        return [i["prompt"] for e in evs if e["type"] == "samples" and e["step"] == step for i in e["items"]]

    for step in (3, 4):
        assert prompts_of(resumed_events, step) == prompts_of(events, step) != []
        for name in ("selection/scored_prompts", "selection/p_est_mean", "selection/effective_prompts"):
            assert resumed[step][name] == pytest.approx(straight[step][name], rel=1e-9), (step, name)
    final = sorted((tmp_path / "b" / "checkpoints").glob("step_*"))[-1]
    sampler_b = json.loads((final / "state.json").read_text())["sampler"]
    sampler_a = json.loads((checkpoints[1] / "state.json").read_text())["sampler"]
    assert sampler_b == sampler_a


@pytest.mark.parametrize("loop", ["async", "partial"])
def test_the_asynchronous_loops_score_with_the_policy(loop: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = likelihood_run(tiny_model_dir, tmp_path / "run", eval_every=0)
    raw["checkpoint"]["every_steps"] = 0
    if loop == "async":
        raw["async"] = {"max_staleness": 1}
    else:
        raw["async"] = {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 2}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    for step in (1, 2, 3, 4):
        assert metrics[step]["selection/scored_prompts"] >= 1, (step, metrics[step])
        assert 0.0 < metrics[step]["selection/p_est_mean"] < 1.0
