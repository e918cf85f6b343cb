"""Prompt statistics and ``data.selection``: the estimators and weights, exactly; concentration and the
exploration floor on a synthetic population; checkpoint round trips; whole runs in every loop.

The synthetic population is three classes of prompts whose true pass rates are 0.97, 0.5 and 0.03
(outcomes drawn from a seeded generator and fed to the selector as scored groups would be): the
selector knows nothing of the classes but what it measures and the prompts' text.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.run
from engine.config import ConfigError, SelectionOptions, build_config, load_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data import Prompt, PromptSampler, PromptSelector, similarity
from engine.data.prompt_stats import PromptRecord, PromptStats, success_values
from engine.data.selection import (
    effective_number,
    explore_count,
    log_weights,
    selection_probabilities,
    zero_variance_probability,
)
from engine.data.similarity import (
    DIM,
    RHO_TOLERANCE,
    beta_binomial_zero_variance,
    increasing_root,
    kernel_pool,
    kernel_predictive,
    ngram_features,
    ngram_matrix,
    reference_dispersion,
)
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


def exact_zero_variance(a: float, b: float, n: int) -> float:
    """The beta-binomial's mass at 0 and at n from its pmf, C(n, k) B(a + k, b + n - k) / B(a, b)."""

    def log_beta(x: float, y: float) -> float:
        return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)

    return sum(math.exp(log_beta(a + k, b + n - k) - log_beta(a, b)) for k in (0, n))


def test_the_selection_weights() -> None:
    options = SelectionOptions(temperature=0.1, alpha=2.0, beta=1.0)
    a, b = np.array([1.0, 5.0, 8.0]), np.array([3.0, 5.0, 2.0])  # posterior means 0.25, 0.5, 0.8
    assert log_weights(a, b, "difficulty_targeted", options, 4).tolist() == pytest.approx(
        [-exact_zero_variance(x, y, 4) / 0.1 for x, y in zip(a, b)], abs=1e-12
    )
    assert log_weights(a, b, "pace", options, 4).tolist() == pytest.approx(  # pace: on the posterior mean
        [math.log(0.25**2 * 0.75), math.log(0.5**2 * 0.5), math.log(0.8**2 * 0.2)], abs=1e-12
    )
    assert log_weights(a, b, "uniform", options, 4).tolist() == [0.0, 0.0, 0.0]
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


def test_the_beta_binomial_chance_of_a_zero_variance_group() -> None:
    """E[p^n + (1 - p)^n] under Beta(a, b) against the beta-binomial pmf (log-gammas) and a Monte-Carlo
    draw; it reduces to the point formula as the Beta concentrates and to 1 as it splits to 0 and 1."""
    cases = [(1.0, 1.0, 8), (0.3, 0.7, 8), (5.0, 5.0, 4), (2.5, 40.0, 16), (0.02, 0.05, 1), (7.0, 1.0, 3)]
    cases += [(0.4, 0.9, 64), (0.4, 0.9, 65), (3.0, 0.5, 700)]  # summed factors, then log-gammas
    a, b, n = (np.array(c, dtype=float) for c in zip(*cases))
    got = beta_binomial_zero_variance(a, b, n.astype(int))  # one n per element
    assert got.tolist() == pytest.approx([exact_zero_variance(*c) for c in cases], rel=1e-10)
    # Log-gammas for every element instead of products of factors up to 64: the same figures.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(similarity, "SUMMED_FACTORS", 0)
        assert beta_binomial_zero_variance(a, b, n.astype(int)).tolist() == pytest.approx(got.tolist(), rel=1e-12)
    # One count for all: the elements with more than 64 factors and those with fewer in one call.
    assert beta_binomial_zero_variance(a, b, 70).tolist() == pytest.approx(
        [exact_zero_variance(x, y, 70) for x, y in zip(a, b)], rel=1e-10
    )
    # Under the uniform prior every count of successes has chance 1 / (n + 1): two of them, 2 / 9.
    assert beta_binomial_zero_variance(1.0, 1.0, 8) == pytest.approx(2 / 9, rel=1e-14)
    assert beta_binomial_zero_variance(np.array([3.0]), np.array([1.0]), 1)[0] == pytest.approx(1.0)
    # Monte Carlo: 200 000 draws of p, then n outcomes; the frequency's SE is at most 0.5/sqrt(2e5)
    # = 0.0011, so 0.006 is more than 5 SE.
    rng = np.random.default_rng(0)
    for x, y, m in [(0.4, 0.6, 8), (3.0, 2.0, 5), (0.5, 0.5, 100)]:
        p = rng.beta(x, y, 200_000)
        wins = rng.binomial(m, p)
        frequency = float(((wins == 0) | (wins == m)).mean())
        assert beta_binomial_zero_variance(x, y, m) == pytest.approx(frequency, abs=0.006)
    # A concentrated Beta is a known p: the point formula; one at 0 and 1 only: always all equal.
    assert beta_binomial_zero_variance(0.3e9, 0.7e9, 8) == pytest.approx(
        zero_variance_probability(0.3, 8), rel=1e-6
    )
    assert beta_binomial_zero_variance(1e-6, 1e-6, 8) == pytest.approx(1.0, abs=1e-5)


def bimodal_population(
    seed: int, clusters: int = 40, per_cluster: int = 100
) -> tuple[list[Prompt], np.ndarray]:
    """Prompts in clusters of similar text; in cluster c a prompt is easy (p ~ Beta(8, 0.5)) with
    chance q_c ~ U(0, 1), else hard (p ~ Beta(0.5, 8)): the text tells the mixture, not the prompt."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list(string.ascii_lowercase), 6)) for _ in range(clusters)]
    share = rng.random(clusters)
    prompts, rates = [], []
    for c in range(clusters):
        for i in range(per_cluster):
            prompts.append(Prompt(uid=f"{c}-{i}", text="", raw=f"{words[c]} {rng.integers(1000)}"))
            rates.append(rng.beta(8, 0.5) if rng.random() < share[c] else rng.beta(0.5, 8))
    return prompts, np.array(rates)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_calibrated_predictive_predicts_how_often_groups_have_zero_variance(seed: int) -> None:
    """1024 references measured with 8 completions each; the other 2976 prompts predicted from their
    text and then sampled 8 times each. The predicted mean chance of a zero-variance group must match
    the measured frequency (about 0.70 here).

    Tolerance: the measured frequency of 2976 groups has SE sqrt(0.7 * 0.3 / 2976) = 0.008; the
    dispersion is fitted to the references' own zero-variance count, whose SE as a frequency is
    sqrt(0.21 / 1024) = 0.014 and which the held-out prediction inherits; together 0.017, and 0.05
    is 3 of them. The point estimate plugged into p^n + (1 - p)^n predicts under 0.1, the kernel's
    nominal evidence unwidened under 0.5: either fails by far more."""
    n, references = 8, 1024
    prompts, rates = bimodal_population(seed)
    rng = np.random.default_rng(100 + seed)
    order = rng.permutation(len(prompts))
    selector = PromptSelector(
        prompts,
        selection="difficulty_targeted",
        options=SelectionOptions(references=references),
        group_size=n,
    )
    for i in order[:references]:
        selector.observe(prompts[i].uid, (rng.random(n) < rates[i]).astype(float).tolist(), step=1)
    held = order[references:].tolist()
    a, b, measured = selector.predictive(held)
    assert not measured.any()
    outcomes = rng.random((len(held), n)) < rates[held][:, None]
    frequency = float((outcomes.all(axis=1) | (~outcomes).all(axis=1)).mean())
    assert 0.6 < frequency < 0.8
    assert float(beta_binomial_zero_variance(a, b, n).mean()) == pytest.approx(frequency, abs=0.05)
    assert float(zero_variance_probability(a / (a + b), n).mean()) < 0.1
    refs = selector.stats.recent(references)
    index = {p.uid: i for i, p in enumerate(prompts)}
    unwidened = kernel_predictive(
        ngram_matrix([prompts[i].raw for i in held]),
        ngram_matrix([prompts[index[uid]].raw for uid, _ in refs]),
        [r for _, r in refs],
        SelectionOptions().bandwidth,
        None,
    )
    assert float(beta_binomial_zero_variance(*unwidened, n).mean()) < 0.5


def test_a_measured_prompt_updates_the_prior_of_its_neighbours() -> None:
    """A measured prompt's predictive is its neighbours' calibrated Beta with its own record left out
    (of the kernel sums and of the pooled prior mean), plus its own successes and failures."""
    prompts = [Prompt(uid=f"p{i}", text="", raw=raw) for i, raw in enumerate(["12+34=", "12+35=", "97+8="])]
    selector = PromptSelector(prompts, selection="difficulty_targeted", group_size=4)
    outcomes = {"p0": [1.0, 1.0, 1.0, 0.0], "p1": [0.0, 0.0, 1.0, 0.0], "p2": [1.0, 1.0, 1.0, 1.0]}
    for uid, values in outcomes.items():
        selector.observe(uid, values, step=1)
    a, b, measured = selector.predictive([0, 1, 2])
    assert measured.all()
    features = ngram_matrix([p.raw for p in prompts])
    records = [r for _, r in selector.stats.recent(256)]
    rho = reference_dispersion(features, records, 0.1)
    for i in range(3):
        others = [j for j in range(3) if j != i]
        prior = kernel_predictive(
            features[i : i + 1], features[others], [records[j] for j in others], 0.1, rho
        )
        s, n = records[i].successes, records[i].attempts
        # rel 1e-6: the selector's features are float32 (cosines rounded to about 6e-8), these float64.
        assert (a[i], b[i]) == pytest.approx((prior[0][0] + s, prior[1][0] + n - s), rel=1e-6)
    # The same through ``own``: the candidate's position among the references is left out.
    left_out = kernel_predictive(features, features, records, 0.1, rho, own=np.array([0, 1, 2]))
    assert left_out[0] + np.array([r.successes for r in records]) == pytest.approx(a, rel=1e-6)


def test_a_stale_record_weighs_less_by_its_half_life() -> None:
    """``half_life``: each of a measured prompt's groups weighs 2^(-age / half_life) in its own part
    of the predictive, age counted to the newest group of any prompt, so a prompt chosen again and
    again is not taken as fresh by its last group; its neighbours' part is unchanged (the references
    keep their counts). The discounted sums round-trip through the checkpoint exactly."""
    prompts = [Prompt(uid=f"p{i}", text="", raw=raw) for i, raw in enumerate(["12+34=", "12+35=", "97+8="])]

    def measured(half_life: int) -> PromptSelector:
        selector = PromptSelector(
            prompts,
            selection="difficulty_targeted",
            options=SelectionOptions(half_life=half_life),
            group_size=4,
        )
        selector.observe("p0", [1.0, 1.0, 1.0, 0.0], step=3)  # 20 steps before the newest group
        selector.observe("p1", [0.0, 0.0, 1.0, 0.0], step=13)  # 10 before
        selector.observe("p0", [0.0, 0.0, 0.0, 0.0], step=13)  # p0 again: its last group is 10 old
        selector.observe("p2", [1.0, 1.0, 1.0, 1.0], step=23)
        return selector

    a0, b0, _ = measured(0).predictive([0, 1, 2])
    selector = measured(10)
    a, b, _ = selector.predictive([0, 1, 2])
    # (successes, failures) as counted without and with the half-life of 10 steps:
    full = np.array([[3.0, 5.0], [1.0, 3.0], [4.0, 0.0]])
    weighted = np.array([[3 * 0.25, 1 * 0.25 + 4 * 0.5], [1 * 0.5, 3 * 0.5], [4.0, 0.0]])
    assert a == pytest.approx(a0 - full[:, 0] + weighted[:, 0], rel=1e-12)
    assert b == pytest.approx(b0 - full[:, 1] + weighted[:, 1], rel=1e-12)
    assert selector.stats.get("p0")[:3] == (8, 3.0, 13)  # the totals stay what was measured
    # A stale mixed record is no longer as sure a bet: its chance of a zero-variance group rose.
    assert beta_binomial_zero_variance(a, b, 4)[1] > beta_binomial_zero_variance(a0, b0, 4)[1]
    resumed = PromptSelector(
        prompts, selection="difficulty_targeted", options=SelectionOptions(half_life=10), group_size=4
    )
    resumed.load_state_dict(json.loads(json.dumps(selector.state_dict())))
    assert resumed.stats.newest_step == 23
    assert resumed.stats.items() == selector.stats.items()
    assert np.array_equal(resumed.predictive([0, 1, 2])[0], a)
    # Without a half-life the checkpoint keeps its earlier form: three numbers a prompt.
    assert all(len(r) == 3 for r in measured(0).state_dict()["selection"]["stats"].values())


def test_the_arrays_by_position_hold_what_the_records_say() -> None:
    """``PromptStats.own`` (one gather for a draw's candidates) against ``PromptRecord.discounted`` of
    each record at the newest step, with and without a half-life, after records and after a
    checkpoint loaded over a table that held others. rel 1e-14: the same product, the weight from
    numpy's power instead of Python's (a few ulps at most)."""
    uids = [f"p{i}" for i in range(6)]
    positions = {u: i for i, u in enumerate(uids)}
    rng = np.random.default_rng(0)
    for half_life in (0, 7):
        stats = PromptStats(half_life, positions)
        for step in range(1, 40):
            uid = uids[int(rng.integers(5))]  # p5 is never measured
            stats.record(uid, (rng.random(4) < 0.5).astype(float).tolist(), step + int(rng.integers(3)))
        rows = []
        for uid in uids:
            r = stats.get(uid)
            attempts, successes = r.discounted(stats.newest_step, half_life) if r else (0.0, 0.0)
            rows.append((successes, attempts))
        got, measured = stats.own(np.arange(6))
        assert got.ravel().tolist() == pytest.approx(np.ravel(rows).tolist(), rel=1e-14) and rows[5] == (0.0, 0.0)
        assert measured.tolist() == [uid in stats for uid in uids] == [True] * 5 + [False]
        loaded = PromptStats(half_life, positions)
        loaded.record("p5", [1.0], 99)  # gone after the load, arrays included
        loaded.load_state_dict(json.loads(json.dumps(stats.state_dict())))
        again, measured_again = loaded.own(np.arange(6))
        assert np.array_equal(again, got) and measured_again.tolist() == measured.tolist()


def test_the_references_are_fitted_once_per_change_of_the_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The references' features and rho are computed again when (and only when) a group is recorded;
    the predictive then equals that of a selector restored from the same state, which builds them from
    scratch: every prompt's own record is left out of the references that hold it, and only of those."""
    prompts, rates = bimodal_population(2, clusters=10, per_cluster=40)
    fits = []
    monkeypatch.setattr(
        engine.data.selection, "reference_dispersion", lambda *args: fits.append(1) or reference_dispersion(*args)
    )
    options = SelectionOptions(references=64, pool=100)
    selector = PromptSelector(prompts, selection="difficulty_targeted", options=options, group_size=8)
    rng = np.random.default_rng(4)
    everything = list(range(len(prompts)))
    for step in range(1, 8):
        for k in (32, 8):  # two rounds a step, as dynamic sampling draws
            before = len(fits)
            batch = selector.next_batch(k)
            selector.predictive(everything)
            selector.estimates(everything[:5])
            assert len(fits) == before + (step > 1 or k == 8)  # one fit a round, none before the first group
            for p in batch:
                i = int(p.uid.split("-")[0]) * 40 + int(p.uid.split("-")[1])
                selector.observe(p.uid, (rng.random(8) < rates[i]).astype(float).tolist(), step)
        restored = PromptSelector(prompts, selection="difficulty_targeted", options=options, group_size=8)
        restored.load_state_dict(selector.state_dict())
        fitted = len(fits)
        for x, y in zip(selector.predictive(everything), restored.predictive(everything)):
            assert np.array_equal(x, y), step
        assert len(fits) == fitted + 2  # the selector's fit for the groups just recorded, and the restored one's
        selector.observe(batch[0].uid, [0.0], step)  # so the next step's first round has a change to fit


def test_uniform_draws_expect_as_many_zero_variance_groups_as_they_get() -> None:
    """``selection/zero_var_expected`` against ``selection/zero_var_frac`` over steps 51-150 of uniform
    draws (32 prompts of 10 000 a step, 8 completions each) on the two-mode population, where the
    plug-in point estimate expected 0.03-0.05.

    Tolerance: 3200 groups give the frequency an SE of sqrt(0.7 * 0.3 / 3200) = 0.008; each step's
    dispersion is fitted on its 256 references (SE 0.03 as a frequency), and the hundred steps'
    reference sets overlap, so their errors average little: 0.06 is about 2 of those plus 3 of the
    former."""
    prompts, rates = bimodal_population(0, clusters=100, per_cluster=100)
    index = {p.uid: i for i, p in enumerate(prompts)}
    rng = np.random.default_rng(1)
    selector = PromptSelector(prompts, selection="uniform", seed=0, group_size=8)
    metrics = []
    for step in range(1, 151):
        for p in selector.next_batch(32):
            selector.observe(p.uid, (rng.random(8) < rates[index[p.uid]]).astype(float).tolist(), step)
        metrics.append(selector.metrics())
    late = metrics[50:]
    expected = np.mean([m["selection/zero_var_expected"] for m in late])
    frequency = np.mean([m["selection/zero_var_frac"] for m in late])
    assert 0.6 < frequency < 0.8
    assert expected == pytest.approx(frequency, abs=0.06)


def test_the_root_of_the_fit_is_bracketed_to_its_tolerance_in_few_evaluations() -> None:
    """``increasing_root`` returns the middle of a bracket no wider than ``tol`` around the root: within
    tol / 2 of it. Smooth functions take a few evaluations where bisection takes 20 (the point of
    it: each is a sum over the references); a step, where false position gains nothing, at most four
    per halving; a root at an end closes the bracket at the next point."""
    cases = [
        (lambda x: x**3 + 0.2 * x - 0.05, 9),  # smooth: superlinear (7 here), bisection 20
        (lambda x: math.expm1(8 * x) - 3.0, 10),  # steep and curved (9): one end would stay
        (lambda x: -1.0 if x < 0.123456 else 1.0, 80),  # a step (23): at most 4 points per halving
        (lambda x: x - 1e-9, 1),  # the root within tol / 2 of an end: the first point closes it
    ]
    for g, most in cases:
        calls: list[float] = []

        def counted(x: float, g=g, calls=calls) -> float:
            calls.append(x)
            return g(x)

        x = increasing_root(counted, 0.0, RHO_TOLERANCE * 2**20, g(0.0), g(RHO_TOLERANCE * 2**20), RHO_TOLERANCE)
        below = max([c for c in calls if g(c) < 0], default=0.0)
        above = min([c for c in calls if g(c) >= 0], default=RHO_TOLERANCE * 2**20)
        assert below <= x <= above and above - below <= RHO_TOLERANCE, (below, x, above)
        assert len(calls) <= most, len(calls)
    # The fit on a population where it matters: to 1e-6 as bisection would be, in under 12 evaluations.
    prompts, rates = bimodal_population(1)
    rng = np.random.default_rng(3)
    records = [PromptRecord(8, float((rng.random(8) < p).sum()), 1) for p in rates[:256]]
    features = ngram_matrix([p.raw for p in prompts[:256]])
    rho = reference_dispersion(features, records, 0.1)
    assert rho is not None and 0.0 < rho < similarity.RHO_MAX
    evals: list[float] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            similarity,
            "increasing_root",
            lambda g, *args: increasing_root(lambda x: evals.append(x) or g(x), *args),
        )
        assert reference_dispersion(features, records, 0.1) == rho
    assert len(evals) < 12


def test_the_dispersion_needs_two_measured_references() -> None:
    f = ngram_matrix(["1+1=", "1+2="])
    assert reference_dispersion(f[:1], [PromptRecord(8, 4.0, 1)], 0.1) is None
    assert reference_dispersion(f, [PromptRecord(8, 4.0, 1), PromptRecord(0, 0.0, 1)], 0.1) is None
    # One attempt is all equal whatever the pass rate: such references tell nothing of the spread.
    assert reference_dispersion(f, [PromptRecord(1, 1.0, 1), PromptRecord(1, 0.0, 1)], 0.1) is None
    # Two references that each saw all-equal groups where their neighbour predicts 1/2: as spread as can be.
    rho = reference_dispersion(f, [PromptRecord(8, 8.0, 1), PromptRecord(8, 0.0, 1)], 0.1)
    assert rho is not None and rho > 0.9


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
    assert kernel_pool(f[None], f[None], [record], 0.1)[0][0] == pytest.approx((2 * m + 3) / 6, abs=1e-7)
    # Orthogonal prompt: weight exp(-1 / 0.1), almost nothing moves it from the prior mean.
    w = math.exp(-10.0)
    assert kernel_pool(far[None], f[None], [record], 0.1)[0][0] == pytest.approx(
        (2 * m + 3 * w) / (2 + 4 * w), abs=1e-7
    )
    assert kernel_pool(f[None], np.zeros((0, DIM)), [], 0.1)[0].tolist() == [0.5]


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
