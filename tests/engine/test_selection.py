"""Prompt statistics and ``data.selection``: the estimators and weights, exactly; concentration and the
exploration floor on a synthetic population; checkpoint round trips; whole runs in every loop.

The synthetic population is three classes of prompts whose true pass rates are 0.97, 0.5 and 0.03
(outcomes drawn from a seeded generator and fed to the selector as scored groups would be): the
selector knows nothing of the classes but what it measures and the prompts' text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.run
from engine.config import ConfigError, SelectionOptions, build_config, load_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data import Prompt, PromptSampler, PromptSelector
from engine.data.prompt_stats import PromptRecord, PromptStats, success_values
from engine.data.selection import (
    effective_number,
    explore_count,
    log_weights,
    selection_probabilities,
    zero_variance_probability,
)
from engine.data.similarity import DIM, kernel_estimates, ngram_features, ngram_matrix
from engine.run import execute
from tests.engine.test_run import metrics_by_step, read_events, small_config

PASS_RATES = {"easy": 0.97, "mid": 0.5, "hard": 0.03}
SELECTIONS = ("uniform", "difficulty_targeted", "pace")


def population(per_class: int) -> list[Prompt]:
    return [
        Prompt(uid=f"{c}-{i}", text=f"{c} problem {i}", raw=f"{c} problem {i}")
        for c in PASS_RATES
        for i in range(per_class)
    ]


def outcome(rng: np.random.Generator, prompt: Prompt, n: int) -> list[float]:
    return (rng.random(n) < PASS_RATES[prompt.uid.split("-")[0]]).astype(float).tolist()


# ----------------------------------------------------------------------------- estimators, exactly


def test_the_beta_posterior_of_a_prompt() -> None:
    r = PromptRecord(attempts=4, successes=3.0, last_step=7)
    assert (r.alpha, r.beta) == (4.0, 2.0)  # Beta(1 + 3, 1 + 4 - 3)
    assert r.mean == 4 / 6
    assert r.std == math.sqrt(4 * 2 / (6**2 * 7))
    never = PromptRecord(0, 0.0, 0)
    assert never.mean == 0.5 and never.std == math.sqrt(1 / 12)  # the uniform prior
    assert success_values([-1.0, 0.25, 1.0, 3.0]) == [0.0, 0.25, 1.0, 1.0]


def test_statistics_accumulate_and_keep_the_measurement_order() -> None:
    stats = PromptStats()
    stats.record("a", [1.0, 0.0], step=1)
    stats.record("b", [0.0, 0.0], step=2)
    stats.record("a", [1.0, 1.0], step=3)
    assert stats.get("a") == PromptRecord(4, 3.0, 3) and stats.get("b") == PromptRecord(2, 0.0, 2)
    assert [uid for uid, _ in stats.recent(5)] == ["b", "a"]  # most recently measured last
    assert [uid for uid, _ in stats.recent(1)] == ["a"]
    again = PromptStats()
    again.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    assert again.items() == stats.items()
    with pytest.raises(ValueError, match="not among this run's training prompts; resume with the same data"):
        PromptStats().load_state_dict(stats.state_dict(), known=["a"])


def test_the_selection_weights() -> None:
    options = SelectionOptions(temperature=0.1, alpha=2.0, beta=1.0)
    p = np.array([0.25, 0.5, 0.8])
    assert log_weights(p, "difficulty_targeted", options).tolist() == pytest.approx(
        [-2.5, 0.0, -3.0], abs=1e-12
    )
    assert log_weights(p, "pace", options).tolist() == pytest.approx(
        [math.log(0.25**2 * 0.75), math.log(0.5**2 * 0.5), math.log(0.8**2 * 0.2)], abs=1e-12
    )
    assert log_weights(p, "uniform", options).tolist() == [0.0, 0.0, 0.0]
    probs = selection_probabilities(np.log(np.array([1.0, 3.0])))
    assert probs.tolist() == pytest.approx([0.25, 0.75], abs=1e-15)
    assert (
        effective_number(np.full(8, 1 / 8)) == pytest.approx(8.0)
        and effective_number(np.array([1.0, 0.0])) == 1.0
    )
    assert zero_variance_probability(np.array([0.5, 0.0, 0.9]), 4).tolist() == pytest.approx(
        [2 / 16, 1.0, 0.9**4 + 0.1**4], abs=1e-15
    )
    cases = {(4, 0.1): 1, (30, 0.1): 3, (10, 0.25): 3, (5, 1.0): 5, (1, 0.01): 1}
    assert {case: explore_count(*case) for case in cases} == cases


def test_the_kernel_estimate_pools_similar_measured_prompts() -> None:
    f = ngram_features("12+34=")
    assert f.shape == (DIM,) and np.linalg.norm(f) == pytest.approx(1.0)
    assert np.array_equal(f, ngram_features("12+34="))  # a fixed hash: the same in every process
    # All of a draw's prompts at once give each its own vector: no n-gram crosses from one text
    # into the next (the 3-gram "=$1" of two texts laid end to end would count).
    texts = ["12+34=", "", "7+8=", "naïve ∑", "12+34="]
    rows = ngram_matrix(texts)
    assert all(np.allclose(rows[i], ngram_features(t)) for i, t in enumerate(texts))
    assert (ngram_features("1") > 0).sum() == 6  # ^ 1 $ ^1 1$ ^1$: six n-grams, six buckets here
    far = np.zeros(DIM)
    far[np.argmin(np.abs(f))] = 1.0  # a bucket "12+34=" does not use: cosine 0
    assert f @ far == 0.0
    record = PromptRecord(4, 3.0, 1)
    m = (1 + 3) / (2 + 4)  # the references' pooled pass rate under the Beta(1, 1) prior: the prior mean
    # Identical prompt: kernel weight exp(0) = 1, so (2 m + 3) / (2 + 4).
    assert kernel_estimates(f[None], f[None], [record], 0.1)[0] == pytest.approx((2 * m + 3) / 6, abs=1e-7)
    # Orthogonal prompt: weight exp(-1 / 0.1), almost nothing moves it from the prior mean.
    w = math.exp(-10.0)
    assert kernel_estimates(far[None], f[None], [record], 0.1)[0] == pytest.approx(
        (2 * m + 3 * w) / (2 + 4 * w), abs=1e-7
    )
    assert kernel_estimates(f[None], np.zeros((0, DIM)), [], 0.1).tolist() == [0.5]


def test_a_never_sampled_prompt_is_estimated_from_similar_measured_ones() -> None:
    """Half of each class measured (8 completions each); the other half, never sampled, gets
    estimates from its text's neighbours that order the classes and put the middle one near 1/2."""
    rng = np.random.default_rng(0)
    prompts = population(40)
    selector = PromptSelector(prompts, selection="difficulty_targeted", group_size=8)
    for p in prompts:
        if int(p.uid.split("-")[1]) % 2 == 0:
            selector.observe(p.uid, outcome(rng, p, 8), step=1)
    means = {}
    for c in PASS_RATES:
        unseen = [i for i, p in enumerate(prompts) if p.uid.startswith(c) and int(p.uid.split("-")[1]) % 2]
        est, measured = selector.estimates(unseen)
        assert not measured.any()
        means[c] = float(est.mean())
    assert means["easy"] > 0.7 and abs(means["mid"] - 0.5) < 0.1 and means["hard"] < 0.3, means


# ----------------------------------------------------------------------------- drawing


def test_uniform_draws_exactly_what_the_epoch_sampler_draws() -> None:
    prompts = population(7)
    plain = PromptSampler(prompts, shuffle=True, seed=3)
    selector = PromptSelector(prompts, selection="uniform", shuffle=True, seed=3, group_size=2)
    rng = np.random.default_rng(1)
    for k in (4, 9, 1, 21, 5):  # across several epochs (21 prompts)
        batch = selector.next_batch(k)
        assert [p.uid for p in batch] == [p.uid for p in plain.next_batch(k)]
        for p in batch:
            selector.observe(p.uid, outcome(rng, p, 2), step=1)
    state = selector.state_dict()
    assert {k: v for k, v in state.items() if k != "selection"} == plain.state_dict()


def test_difficulty_targeted_concentrates_on_the_middle_and_the_floor_feeds_every_prompt() -> None:
    """90 prompts, 6 a batch, explore 0.2: 2 of each batch come from the epoch sampler, so every prompt
    is drawn in each epoch of 45 batches however little the weights want it."""
    prompts = population(30)
    rng = np.random.default_rng(0)
    shares, seen_per_epoch = {}, {}
    for selection in SELECTIONS:
        selector = PromptSelector(
            prompts, selection=selection, options=SelectionOptions(explore=0.2), seed=1, group_size=4
        )
        counts = dict.fromkeys(PASS_RATES, 0)
        epochs: list[set[str]] = [set(), set(), set(), set()]
        metrics = []
        for step in range(1, 181):
            batch = selector.next_batch(6)
            assert len(batch) == 6 and len({p.uid for p in batch[2:]}) == 4  # weighted part: no repeats
            epochs[(step - 1) // 45].update(p.uid for p in batch)
            for p in batch:
                counts[p.uid.split("-")[0]] += 1
                selector.observe(p.uid, outcome(rng, p, 4), step)
            metrics.append(selector.metrics())
        shares[selection] = {c: n / (6 * 180) for c, n in counts.items()}
        seen_per_epoch[selection] = [len(e) for e in epochs]
        late = metrics[90:]
        assert all(0.0 <= m["selection/zero_var_frac"] <= 1.0 for m in late)
        if selection != "uniform":
            assert all(1.0 <= m["selection/effective_prompts"] <= 90.0 + 1e-9 for m in late)
        if selection == "difficulty_targeted":
            assert np.mean([m["selection/p_est_mean"] for m in late]) == pytest.approx(0.5, abs=0.1)
            assert np.mean([m["selection/zero_var_avoided"] for m in late]) > 0.15
            observed = np.mean([m["selection/zero_var_frac"] for m in late])
    assert all(seen == [90, 90, 90, 90] for seen in seen_per_epoch.values()), seen_per_epoch
    assert shares["uniform"]["mid"] == pytest.approx(1 / 3, abs=0.05)
    assert shares["difficulty_targeted"]["mid"] > 0.65, shares
    assert shares["uniform"]["mid"] < shares["pace"]["mid"] < shares["difficulty_targeted"]["mid"], shares
    # Fewer groups without a learning signal than uniform draws get (3/4 of them: 0.97^4 + 0.03^4 ...).
    assert observed < 0.5


@settings(max_examples=40, deadline=None)
@given(
    n_prompts=st.integers(1, 30),
    k=st.integers(1, 12),
    explore=st.floats(0.01, 1.0),
    selection=st.sampled_from(SELECTIONS),
    pool=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_selection_stays_in_bounds_and_starves_no_prompt(
    n_prompts: int, k: int, explore: float, selection: str, pool: int, seed: int
) -> None:
    """Whatever the sizes and outcomes: every batch has k of the run's prompts, estimates are strictly
    inside (0, 1), the metrics within their ranges, and the exploration floor's m prompts a batch
    draw every prompt once per epoch: epoch e spans batches e N // m + 1 to ceil((e + 1) N / m)."""
    prompts = [Prompt(uid=f"p{i}", text=str(i), raw=f"{i * 7919 % 1000}+{i}=") for i in range(n_prompts)]
    options = SelectionOptions(explore=explore, pool=pool, references=8)
    selector = PromptSelector(prompts, selection=selection, options=options, seed=seed, group_size=3)
    rng = np.random.default_rng(seed)
    rates = rng.random(n_prompts)
    m = explore_count(k, explore) if selection != "uniform" else k
    epochs = [(e * n_prompts // m + 1, math.ceil((e + 1) * n_prompts / m)) for e in range(3)]
    drawn_in: list[set[str]] = []
    for step in range(1, epochs[-1][1] + 1):
        batch = selector.next_batch(k)
        assert len(batch) == k and {p.uid for p in batch} <= {p.uid for p in prompts}
        drawn_in.append({p.uid for p in batch})
        for p in batch:
            selector.observe(p.uid, (rng.random(3) < rates[int(p.uid[1:])]).astype(float).tolist(), step)
        metrics = selector.metrics()
        assert (
            0.0 < metrics["selection/p_est_mean"] < 1.0 and 0.0 <= metrics["selection/zero_var_frac"] <= 1.0
        )
        assert 0.0 <= metrics["selection/measured_frac"] <= 1.0
        if "selection/effective_prompts" in metrics:
            assert 1.0 - 1e-9 <= metrics["selection/effective_prompts"] <= max(pool, k) + 1e-9
    for lo, hi in epochs:
        seen = set().union(*drawn_in[lo - 1 : hi])
        assert seen == {p.uid for p in prompts}, (lo, hi, sorted({p.uid for p in prompts} - seen))
    p, _ = selector.estimates(list(range(n_prompts)))
    assert ((p > 0) & (p < 1)).all()


def test_a_selector_restored_from_its_state_draws_what_the_original_draws() -> None:
    prompts = population(20)
    for selection in SELECTIONS:
        rng = np.random.default_rng(5)
        options = SelectionOptions(pool=16)
        straight = PromptSelector(prompts, selection=selection, options=options, seed=2, group_size=4)
        saved = None
        drawn = []
        for step in range(1, 13):
            if step == 7:
                saved = json.loads(json.dumps(straight.state_dict()))  # as state.json holds it
            batch = straight.next_batch(5)
            drawn.append([p.uid for p in batch])
            for p in batch:
                straight.observe(p.uid, outcome(rng, p, 4), step)
        resumed = PromptSelector(prompts, selection=selection, options=options, seed=2, group_size=4)
        resumed.load_state_dict(saved)
        rng = np.random.default_rng(5)
        for step in range(1, 7):  # the outcomes the straight run saw before its state was taken
            for _ in drawn[step - 1]:
                rng.random(4)
        for step in range(7, 13):
            batch = resumed.next_batch(5)
            assert [p.uid for p in batch] == drawn[step - 1], (selection, step)
            for p in batch:
                resumed.observe(p.uid, outcome(rng, p, 4), step)
        assert resumed.state_dict() == straight.state_dict()


def test_selection_config_errors_name_the_field() -> None:
    assert load_config("grpo").data.selection == "uniform"
    with pytest.raises(ConfigError, match=r"data.selection_options: alpha and beta are both 0"):
        load_config(
            "grpo", ["data.selection=pace", "data.selection_options.alpha=0", "data.selection_options.beta=0"]
        )
    with pytest.raises(
        ConfigError, match=r"data.selection: Input should be 'uniform', 'difficulty_targeted' or 'pace'"
    ):
        load_config("grpo", ["data.selection=hardest"])
    with pytest.raises(ConfigError, match=r"data.selection_options.explore: Input should be greater than 0"):
        load_config("grpo", ["data.selection_options.explore=0"])
    with pytest.raises(
        ConfigError, match=r"data.selection_options.temperature: Input should be greater than 0"
    ):
        load_config("grpo", ["data.selection_options.temperature=0"])


# ----------------------------------------------------------------------------- whole runs

SELECTION_METRICS = ("selection/p_est_mean", "selection/zero_var_frac", "selection/prompts_seen")
WEIGHTED_METRICS = ("selection/zero_var_avoided", "selection/effective_prompts")
NONDETERMINISTIC = ("timing_s/", "perf/", "async/", "system/")  # system/*: the process's CPU and memory


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Whole runs here train on one intra-op thread: on a shared 2-core machine under load, torch's
    spinning worker threads made a 3-step synchronous run take 35-50 s instead of 3 s. Nothing here
    compares runs across thread counts (see LOGPROB_TOL in test_async.py for why that would matter)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deterministic(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {s: {k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC)} for s, m in metrics.items()}


def run_metrics(raw: dict, out: Path) -> dict[int, dict[str, float]]:
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    return deterministic(metrics_by_step(read_events(out / "events.jsonl")))


def test_uniform_selection_trains_exactly_as_the_plain_sampler(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default run against the same run with the epoch sampler alone (the engine before prompt
    selection): the same prompts, tokens, rewards and updates, bit for bit; only selection/* is new."""
    raw = small_config(tiny_model_dir, tmp_path / "selector", total_steps=3)
    with_selector = run_metrics(raw, tmp_path / "selector")
    monkeypatch.setattr(
        engine.run.PromptSelector,
        "from_config",
        lambda cfg, prompts: PromptSampler(prompts, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed),
    )
    plain = run_metrics(small_config(tiny_model_dir, tmp_path / "plain", total_steps=3), tmp_path / "plain")
    for step in (1, 2, 3):
        assert all(name in with_selector[step] for name in SELECTION_METRICS)
        ours = {k: v for k, v in with_selector[step].items() if not k.startswith("selection/")}
        assert ours == plain[step], step


def test_resume_with_selection_makes_the_same_choices(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Steps 3-4 resumed from the step-2 checkpoint draw the prompts the straight run drew (the
    final checkpoints hold the same statistics and draw count) and report the same metrics."""
    raw = small_config(tiny_model_dir, tmp_path / "a", total_steps=4)
    raw["data"].update(
        {"selection": "difficulty_targeted", "selection_options": {"pool": 64, "explore": 0.25}}
    )
    straight = run_metrics(raw, tmp_path / "a")
    events = read_events(tmp_path / "a" / "events.jsonl")
    checkpoints = [Path(e["path"]) for e in events if e["type"] == "checkpoint"]
    assert len(checkpoints) == 2
    raw["output_dir"] = str(tmp_path / "b")
    assert execute(build_config(raw), resume=str(checkpoints[0])) == EXIT_SUCCEEDED
    resumed = deterministic(metrics_by_step(read_events(tmp_path / "b" / "events.jsonl")))
    for step in (3, 4):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6, abs=1e-7), step
        for name in SELECTION_METRICS + WEIGHTED_METRICS:
            assert resumed[step][name] == straight[step][name], (step, name)
    final = sorted((tmp_path / "b" / "checkpoints").glob("step_*"))[-1]
    sampler_b = json.loads((final / "state.json").read_text())["sampler"]
    sampler_a = json.loads((checkpoints[1] / "state.json").read_text())["sampler"]
    assert sampler_b == sampler_a
    assert sampler_a["selection"]["draws"] == 4 * 1  # one weighted draw a step (dynamic sampling off)
    assert sum(v[0] for v in sampler_a["selection"]["stats"].values()) == 4 * 4 * 4  # steps x prompts x n


def test_an_async_checkpoint_holds_the_selection_before_the_next_batch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With the producer up to two steps ahead, the step-2 checkpoint holds the statistics and draw
    count from before step 3's batch (not those of the batches generated ahead), so the resumed run
    draws step 3's prompts as the straight run did."""
    raw = small_config(tiny_model_dir, tmp_path / "a", total_steps=4, eval_every=0)
    raw["data"].update(
        {"selection": "difficulty_targeted", "selection_options": {"pool": 64, "explore": 0.25}}
    )
    raw["async"] = {"max_staleness": 2}
    straight = run_metrics(raw, tmp_path / "a")
    events = read_events(tmp_path / "a" / "events.jsonl")
    first = Path(next(e["path"] for e in events if e["type"] == "checkpoint" and e["step"] == 2))
    sampler = json.loads((first / "state.json").read_text())["sampler"]
    assert sampler["selection"]["draws"] == 2 and sampler["position"] == 2  # one explored prompt a step
    assert sum(v[0] for v in sampler["selection"]["stats"].values()) == 2 * 4 * 4
    raw["output_dir"] = str(tmp_path / "b")
    assert execute(build_config(raw), resume=str(first)) == EXIT_SUCCEEDED
    resumed_events = read_events(tmp_path / "b" / "events.jsonl")
    resumed = metrics_by_step(resumed_events)
    for name in ("selection/p_est_mean", "selection/effective_prompts", "selection/zero_var_expected"):
        assert resumed[3][name] == straight[3][name], name

    def prompts_of(evs: list[dict], step: int) -> list[str]:
        return [i["prompt"] for e in evs if e["type"] == "samples" and e["step"] == step for i in e["items"]]

    assert prompts_of(resumed_events, 3) == prompts_of(events, 3) != []


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("loop", ["sync", "async", "partial"])
def test_every_loop_reports_selection_metrics(
    selection: str, loop: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=3, eval_every=0)
    raw["data"]["selection"] = selection
    raw["checkpoint"]["every_steps"] = 0
    if loop == "async":
        raw["async"] = {"max_staleness": 1}
    elif loop == "partial":
        raw["async"] = {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 2}
    metrics = run_metrics(raw, tmp_path / "run")
    for step in (1, 2, 3):
        m = metrics[step]
        for name in SELECTION_METRICS + (WEIGHTED_METRICS if selection != "uniform" else ()):
            assert name in m, (step, name, sorted(k for k in m if k.startswith("selection/")))
        assert 0.0 < m["selection/p_est_mean"] < 1.0
        assert m["selection/prompts_seen"] >= 4  # the first step's four prompts at least
