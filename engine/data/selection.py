"""Which prompts get rollouts (``data.selection``): uniform epochs, or weighted by estimated pass rate.

A group of n completions whose rewards are all equal carries no GRPO gradient (its advantages
are all zero); for a prompt of pass rate p that happens with probability p^n + (1 - p)^n, least at
p = 1/2. But p is never known, only predicted: every prompt gets a Beta(a, b) predictive of its
pass rate (step 3 below), and the chance of a zero-variance group is the beta-binomial's

    P0 = E[p^n + (1 - p)^n] = B(a + n, b) / B(a, b) + B(a, b + n) / B(a, b),

which is what a selection wants low. Plugging the predictive mean into p^n + (1 - p)^n instead
ignores how uncertain p is: of prompts predicted near 1/2 many are really near 0 or 1, and on
held-out prompts the plug-in figure was 0.030 where 0.165 of the groups had zero variance (the
calibrated P0 said 0.176; the decile table is in ``engine/data/similarity.py``). Both weighted
selections spend the rollouts where P0 is low:

* ``uniform`` (the default): the shuffled epochs of :class:`~engine.data.prompts.PromptSampler`,
  exactly as without this module (the same prompts in the same order, the same random streams);
* ``difficulty_targeted`` (DOTS: Sun et al. 2025, "Improving Data Efficiency for LLM
  Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
  Replay", arXiv:2506.05316): prefer prompts whose pass rate is near 1/2 by what that buys, a low
  P0: w = exp(-P0 / tau), ``tau`` = ``data.selection_options.temperature`` (a softmax over -P0: a
  prompt with a P0 higher by tau weighs e times less; tau -> 0 takes the lowest P0 only). For a
  known p, P0 is least at p = 1/2 and grows with |p - 1/2|, so this is DOTS' preference; with an
  uncertain p it also prefers a prompt measured at 4 of 8 (Beta(5, 5): P0 = 0.04 for n = 8) over
  one never sampled and predicted 1/2 from its neighbours (Beta(1.6, 1.6), about as wide as
  ``bench/selection_predictor.py`` finds them: P0 = 0.14), which a weight on the mean alone ranks
  the same;
* ``pace`` (PACED): w(p) = p^alpha (1 - p)^beta on the predictive mean p = a / (a + b), ``alpha``
  and ``beta`` from ``data.selection_options``; alpha = beta = 1 gives p (1 - p), the variance of
  one completion's success, which vanishes with the gradient's signal-to-noise ratio at both
  extremes.

How a weighted batch of k prompts is drawn:

1. **exploration floor**: m = ceil(explore * k) of them (``data.selection_options.explore``) come
   from the uniform epoch sampler, which draws every prompt once per epoch of N prompts. Two draws
   of a prompt are at most 2N - 1 epoch positions apart, so whatever the weights, any
   ceil((2N - 1) / m) consecutive batches draw every prompt: none starves, and the estimates of
   all of them keep being refreshed;
2. **candidates**: ``data.selection_options.pool`` prompts drawn uniformly without replacement
   (all of them when there are fewer), so a batch costs the same however large the dataset;
3. **predictives**: every candidate gets the kernel-pooled Beta of its neighbours among the most
   recently measured prompts (``engine/data/similarity.py``, the cheap equivalent of DOTS'
   attention-based predictor), widened by the dispersion of true pass rates around the kernel
   mean that those references show (fitted so that they predict their own zero-variance groups as
   often as these happened); a measured prompt's own s successes in n attempts update it to
   Beta(a + s', b + n' - s') (its own record left out of the neighbours), where s' and n' count each
   of its groups with weight 2^(-age / h), age in steps to the newest group of any prompt and h =
   ``data.selection_options.half_life`` (s' = s, n' = n when h is 0): the policy has moved since, so
   an old 4 of 8 is weaker evidence of a pass rate near 1/2 now than a fresh one. That prior, not
   the uniform
   Beta(1, 1) of ``engine/data/prompt_stats.py``, is what keeps measured prompts calibrated: on a
   synthetic population whose pass rates pile up near 0 and 1, the prompts ``difficulty_targeted``
   chose again after measuring them were predicted 0.21 and had 0.39 zero-variance groups with the
   uniform prior, 0.20 and 0.30 with the neighbours' (``tests/engine/test_selection.py``'s
   ``bimodal_population``, 20 000 prompts, 150 steps of 32, n = 8);
   With ``data.selection_options.predictor: answer_likelihood`` the prior is instead the policy's own
   chance q of writing the prompt's reference answer, Beta(c q, c (1 - q)) (``engine/data/likelihood.py``:
   it correlates 0.80 with measured pass rates where the neighbours' kernel reaches 0.15-0.22), and
   the candidates are not a fresh uniform pool but a standing one that each draw tops up with
   c / (1 - P0) scored prompts per pick (c = ``likelihood_candidates_per_pick``, P0 what a uniform
   draw expects; scoring costs a forward a prompt);
4. **draw**: the rest of the batch without replacement with probability proportional to w
   among the candidates, by Gumbel-top-k (the k largest of log w_i + G_i, G_i ~ Gumbel(0, 1), are a
   sample without replacement proportional to w: Kool, van Hoof and Welling 2019, "Stochastic
   Beams and Where to Find Them", ICML), with its own random stream seeded by (trainer.seed, the
   number of batches drawn so far): a resumed run draws what an uninterrupted one would.

What a draw costs: one predictive, for the explored prompts and the candidates together, whose
references (their features, records and rho) are built once per change of the statistics, i.e.
once a round, since every round records its groups; the candidates' own records are one gather
from arrays by position (``engine/data/prompt_stats.py``). ``next_batch(32)`` on the state of a
300-step simulation of the 50,000 arithmetic prompts (one core, medians): 5.1 ms when the
references changed since the last draw (as in a run: a fit of rho) and 2.2 ms when not, where two
predictives reading records by uid, P0 computed three times and rho fitted by bisection took 13.7
and 4.8; most of the rest is the candidates x references kernel. Uniform draws (their metrics ask
for the chosen prompts' predictive) 3.0 ms with a fit, 7.8 before. ``bench/selection_predictor.py
--draw-cost`` times it on its own simulation (4.8 and 2.2 ms; uniform 1.4).

Metrics (``selection/*``, per step): ``p_est_mean`` (mean predictive mean pass rate of the chosen
prompts), ``measured_frac`` (the share of them with statistics of their own, the rest predicted),
``zero_var_frac`` (of the groups scored this step, the share whose completions all succeeded or
all failed), ``zero_var_expected`` (the same predicted: the mean P0 of the chosen prompts, n =
``rollout.n``) and, for the weighted selections, ``zero_var_expected_uniform`` (what a uniform
draw would expect: the mean P0 over the uniformly drawn candidates), ``zero_var_avoided``
(the difference: zero-variance groups avoided per group relative to uniform) and
``effective_prompts`` (exp of the entropy of the selection probabilities over the candidates: how
many prompts the weights effectively spread over). ``prompts_seen`` counts the prompts measured.
With ``predictor: answer_likelihood``, ``scored_prompts`` and ``scoring_s``: the prompts the policy
scored this step and the seconds it took (what the predictor costs).

``zero_var_expected`` is calibrated where the draw does not look at the prediction. In
``bench/data_efficiency.py``'s DAPO runs (50 000 prompts, 600 steps, seeds 0 and 1) uniform draws
expected 0.288 and 0.292 of their groups to have zero variance and had 0.289 and 0.292 (each
chosen prompt's P0 against its group: 0.237/0.238 over steps 1-300, 0.347/0.348 over 301-600);
before the calibration the figure was 0.013-0.024 against 0.20-0.33. ``difficulty_targeted``
reads low, 0.161 and 0.163 against 0.238 and 0.237, for two reasons the predictive does not model:
it picks the prompts whose P0 came out lowest, partly by chance (winner's curse: over steps
301-600 of seed 1 its never-sampled picks were predicted 0.236 and had 0.352, no better than
uniform's 0.348), and a measured prompt's record pools outcomes from earlier policies that have
since improved (its re-measured picks: predicted 0.087, had 0.191). It still had fewer
zero-variance groups than uniform (0.259 against 0.347 over steps 301-600), from the measured
prompts it goes back to. The same on synthetic populations (``tests/engine/test_selection.py``'s
``bimodal_population``): uniform draws expected 0.690 and had 0.694; weighted draws' never-sampled
picks 0.55 against 0.70.

The defaults, temperature 0.05 and half-life 25 steps, come from 1,200-step DAPO runs from the
arithmetic starter (seed 0, ``algorithm.filter_groups.round_size=deficit``, one core each, two at
a time). At 0.1 the weights spread over 820-1,000 of the 1,024 candidates (``effective_prompts``)
and the draws had about as many zero-variance groups as uniform ones (0.200 against 0.224 over
steps 251-300); at 0.02 over 3-20 from step 300 on, most of a batch from a handful of prompts; at
0.05 over ~950 at first and ~40 once most candidates were measured. Discounting a record by the age
of its last group alone (all that totals allow) left a prompt chosen every few steps with a pooled
record of 1/2 long after the policy had solved it: at 0.02 the draws expected 0.16 of their groups
to have zero variance and had 0.64 (steps 1051-1100), and the run ended at 0.949 eval accuracy
against uniform's 0.969; with a half-life of 25, expected
0.31 and had 0.56, and it ended at 0.975 (0.979 at temperature 0.05), on 0.68-0.70x uniform's
generated tokens (1.84-1.88M against 2.70M) and 0.93-0.94x its training time: the update, not the
generation, is most of a step here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import DataConfig, RunConfig
from engine.config.model_data import SelectionOptions, scores_answers
from engine.data.likelihood import AnswerScorer, CandidatePool, likelihood_beta
from engine.data.prompt_stats import PRIOR_A, PRIOR_B, PromptRecord, PromptStats
from engine.data.prompts import Prompt, PromptSampler
from engine.data.similarity import (
    FeatureCache,
    beta_binomial_zero_variance,
    kernel_predictive,
    reference_dispersion,
)

_STREAM = 0x5E1EC7
"""Salt of the selection's random stream (kept apart from every other seeded stream of the run)."""


def log_weights(
    a: np.ndarray,
    b: np.ndarray,
    selection: str,
    options: SelectionOptions,
    n: int,
    zero_var: np.ndarray | None = None,
) -> np.ndarray:
    """log w of the selection for prompts whose pass rates are predicted Beta(a, b) (a, b > 0), n
    completions a group (see the module docstring): ``difficulty_targeted`` -P(zero-variance) / tau
    (``zero_var``: that P when the caller has it already), ``pace`` on the posterior mean
    p = a / (a + b), which is strictly inside (0, 1)."""
    if selection == "difficulty_targeted":
        if zero_var is None:
            zero_var = beta_binomial_zero_variance(a, b, n)
        return -zero_var / options.temperature
    if selection == "pace":
        p = a / (a + b)
        return options.alpha * np.log(p) + options.beta * np.log1p(-p)
    return np.zeros_like(a)


def selection_probabilities(logw: np.ndarray) -> np.ndarray:
    """Normalised weights w_i / sum_j w_j, computed stably from log weights."""
    w = np.exp(logw - logw.max())
    return w / w.sum()


def zero_variance_probability(p: np.ndarray, n: int) -> np.ndarray:
    """Chance that n independent completions of a known pass rate p all succeed or all fail."""
    return p**n + (1.0 - p) ** n


def effective_number(probs: np.ndarray) -> float:
    """exp(entropy) of a distribution: N for uniform over N, 1 for a point mass."""
    nz = probs[probs > 0]
    return float(np.exp(-(nz * np.log(nz)).sum()))


def explore_count(k: int, explore: float) -> int:
    """Prompts of a k-prompt batch drawn by the epoch sampler (the exploration floor)."""
    return min(k, math.ceil(explore * k - 1e-9))


@dataclass
class _StepTally:
    """What the step's draws and observations add up to, for its ``selection/*`` metrics."""

    chosen: int = 0
    chosen_p: float = 0.0  # sums over the chosen prompts: predictive mean,
    chosen_zero_var: float = 0.0  # predicted P(zero-variance group),
    chosen_measured: int = 0  # and those measured
    pool: int = 0
    pool_zero_var: float = 0.0  # weighted draws: expected, summed over the candidates
    effective: list[float] = field(default_factory=list)
    groups: int = 0
    zero_var_groups: int = 0
    scored: int = 0  # answer_likelihood: prompts the policy scored, and the seconds it took
    scoring_s: float = 0.0


@dataclass
class _References:
    """The reference set of one revision of the statistics and what every predictive takes from it
    (computed once per revision, however many predictives a revision serves)."""

    revision: int
    positions: np.ndarray  # of the references among the prompts, least recently measured first
    features: np.ndarray
    records: list[PromptRecord]
    rho: float | None


class PromptSelector:
    """The run's prompt source: ``next_batch(k)`` as :class:`PromptSampler`, plus prompt statistics.

    ``observe(uid, values, step)`` records a scored group (success values in [0, 1]); ``metrics()``
    returns and resets the step's ``selection/*`` metrics. ``state_dict()`` is the epoch sampler's
    (its keys unchanged, so older checkpoints load) with a ``selection`` entry holding the number of
    weighted draws and the statistics.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        *,
        selection: str = "uniform",
        options: SelectionOptions | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group_size: int = 1,
    ) -> None:
        self.epochs = PromptSampler(prompts, shuffle=shuffle, seed=seed)
        self._prompts = list(prompts)
        self._index = {p.uid: i for i, p in enumerate(self._prompts)}
        self.selection = selection
        self.options = options or SelectionOptions()
        self.seed = int(seed)
        self.group_size = group_size
        self.stats = PromptStats(self.options.half_life, self._index)
        self.draws = 0  # weighted batches drawn so far: the key of the next one's random stream
        self._features = FeatureCache([p.raw for p in self._prompts])
        self._refs: _References | None = None
        # A prompt's position among the current references (-1: not one), for leaving its own record out.
        self._slot = np.full(len(self._prompts), -1, dtype=np.int64)
        self._tally = _StepTally()
        self.scorer: AnswerScorer | None = None
        self.candidates = CandidatePool()  # answer_likelihood's standing pool (engine/data/likelihood.py)
        self.uniform_zero_var = 0.5  # answer_likelihood: P0 a uniform draw expects (``_fresh_count``)

    @classmethod
    def from_config(cls, cfg: RunConfig, prompts: Sequence[Prompt]) -> PromptSelector:
        data: DataConfig = cfg.data
        return cls(
            prompts,
            selection=data.selection,
            options=data.selection_options,
            shuffle=data.shuffle,
            seed=cfg.trainer.seed,
            group_size=cfg.rollout.n,
        )

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def uses_likelihood(self) -> bool:
        """Whether draws score candidates with the policy (``engine.config.model_data.scores_answers``)."""
        return scores_answers(self.selection, self.options)

    def attach_scorer(self, scorer: AnswerScorer) -> None:
        """The policy's scorer for ``predictor: answer_likelihood`` (the rollout backend exists only
        after the prompts are loaded, so it is attached, not passed)."""
        self.scorer = scorer

    # -- estimates ------------------------------------------------------------------------------

    def predictive(
        self, indices: Sequence[int], scores: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The Beta(a, b) predictive of the pass rates of the prompts ``indices``, and whether each was
        measured itself. Every prompt starts from a prior: with ``scores`` (the policy's answer
        likelihoods q, ``engine/data/likelihood.py``) Beta(c q, c (1 - q)); without, or where a score
        is NaN (no reference answer), the calibrated kernel predictive of its neighbours among the
        references (``engine/data/similarity.py``; its own record left out). A measured prompt's s
        successes in n attempts update it to Beta(a + s, b + n - s)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        counts, measured = self.stats.own(indices)  # (successes, attempts), zeros if never sampled
        if scores is None:
            a, b = self._neighbours(indices)
        else:
            a, b = likelihood_beta(np.nan_to_num(scores, nan=0.5), self.options.likelihood_strength)
            unscored = np.isnan(scores)
            if unscored.any():
                a[unscored], b[unscored] = self._neighbours(indices[unscored])
        return a + counts[:, 0], b + counts[:, 1] - counts[:, 0], measured

    def _neighbours(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        refs = self._references()
        if refs is None or not len(indices):
            return np.full(len(indices), PRIOR_A), np.full(len(indices), PRIOR_B)
        return kernel_predictive(
            self._features.matrix(indices),
            refs.features,
            refs.records,
            self.options.bandwidth,
            refs.rho,
            own=self._slot[indices],
        )

    def estimates(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Estimated pass rates (predictive means) of the prompts ``indices`` and whether each was measured."""
        a, b, measured = self.predictive(indices)
        return a / (a + b), measured

    def _references(self) -> _References | None:
        """The current references (the ``data.selection_options.references`` prompts measured most
        recently) with their features and rho (``engine/data/similarity.py``), built again only when
        the statistics changed. A function of the statistics alone, so a resumed run fits what an
        uninterrupted one did."""
        if self._refs is not None and self._refs.revision == self.stats.revision:
            return self._refs
        if self._refs is not None:
            self._slot[self._refs.positions] = -1
        recent = self.stats.recent(self.options.references)
        if not recent:
            self._refs = None
            return None
        positions = np.array([self._index[uid] for uid, _ in recent], dtype=np.int64)
        features = self._features.matrix(positions)
        records = [r for _, r in recent]
        rho = reference_dispersion(features, records, self.options.bandwidth)
        self._slot[positions] = np.arange(len(positions))
        self._refs = _References(self.stats.revision, positions, features, records, rho)
        return self._refs

    # -- drawing --------------------------------------------------------------------------------

    def next_batch(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (see the module docstring for how the weighted selections draw)."""
        if self.selection == "uniform":
            batch = self.epochs.next_batch(k)
            a, b, measured = self.predictive([self._index[p.uid] for p in batch])
            self._note_chosen(a, b, measured, beta_binomial_zero_variance(a, b, self.group_size))
            return batch
        if self.uses_likelihood:
            return self._likelihood_batch(k)
        explored = [
            self._index[p.uid] for p in self.epochs.next_batch(explore_count(k, self.options.explore))
        ]
        pool, rng = self._pool(k - len(explored), set(explored)) if k > len(explored) else ([], None)
        # One predictive for both: the explored prompts' (for the metrics) and the candidates'.
        a, b, measured = self.predictive(explored + pool)
        zero_var = beta_binomial_zero_variance(a, b, self.group_size)
        m = len(explored)
        self._note_chosen(a[:m], b[:m], measured[:m], zero_var[:m])
        if rng is None:
            return [self._prompts[i] for i in explored]
        picked, _ = self._weighted(k - m, a[m:], b[m:], measured[m:], zero_var[m:], rng)
        return [self._prompts[i] for i in explored + [pool[j] for j in picked]]

    def _likelihood_batch(self, k: int) -> list[Prompt]:
        """``next_batch`` with ``predictor: answer_likelihood`` (``engine/data/likelihood.py``): the
        exploration floor as for the other predictor; the standing pool loses its expired candidates and
        the explored prompts, gains ``likelihood_candidates_per_pick`` freshly drawn prompts per prompt
        to pick (scored by the policy in one call with the explored ones, whose predictive the metrics
        report), the rest of the batch is drawn from it by weight, and what is left keeps its ``pool``
        best candidates for the next draws."""
        if self.scorer is None:
            raise RuntimeError(
                "data.selection_options.predictor 'answer_likelihood' needs the policy's scorer: "
                "PromptSelector.attach_scorer(AnswerScorer(backend, tokenizer, temperature)) before drawing"
            )
        o, pool = self.options, self.candidates
        explored = [self._index[p.uid] for p in self.epochs.next_batch(explore_count(k, o.explore))]
        m, want = len(explored), k - len(explored)
        rng = np.random.default_rng([self.seed, self.draws, _STREAM])
        self.draws += 1
        version = self.scorer.version
        pool.expire(version, o.likelihood_max_age)
        pool.remove(set(explored))
        n, taken = len(self._prompts), set(pool.positions) | set(explored)
        if len(pool) + n - len(taken) < want:  # too few prompts: the explored ones may repeat
            taken = set(pool.positions)
        fresh = min(max(self._fresh_count(want), want - len(pool)), n - len(taken)) if want else 0
        new: list[int] = []
        if fresh > 0:
            drawn = rng.choice(n, size=min(n, fresh + len(taken)), replace=False).tolist()
            new = [i for i in drawn if i not in taken][:fresh]
        start = time.perf_counter()
        q = self.scorer([self._prompts[i] for i in explored + new])
        self._tally.scoring_s += time.perf_counter() - start
        self._tally.scored += int((~np.isnan(q)).sum())
        pool.add(new, version, q[m:])
        a, b, measured = self.predictive(explored + pool.positions, np.concatenate([q[:m], pool.scores]))
        zero_var = beta_binomial_zero_variance(a, b, self.group_size)
        if new:  # the fresh candidates are a uniform draw: their mean P0 is what a uniform batch expects
            self.uniform_zero_var = float(zero_var[m + len(pool) - len(new) :].mean())
        self._note_chosen(a[:m], b[:m], measured[:m], zero_var[:m])
        if want <= 0 or not len(pool):
            return [self._prompts[i] for i in explored]
        picked, logw = self._weighted(want, a[m:], b[m:], measured[m:], zero_var[m:], rng)
        chosen = [pool.positions[j] for j in picked]
        pool.keep_best(logw, set(picked), o.pool)
        return [self._prompts[i] for i in explored + chosen]

    def _fresh_count(self, want: int) -> int:
        """Fresh candidates to score for ``want`` picks: ``likelihood_candidates_per_pick`` per pick,
        divided by the share of uniformly drawn prompts whose groups carry a signal, 1 - P0 (the
        fresh candidates' mean predicted P0 at the last draw that scored any; 1/2 before): a uniform
        draw of c / (1 - P0) prompts holds about c with a signal. Early in a run most prompts have one
        and a few candidates a pick do; once most are solved it takes many, at most
        ``likelihood_max_candidates_per_pick`` a pick."""
        o = self.options
        per_pick = o.likelihood_candidates_per_pick / max(1.0 - self.uniform_zero_var, 1e-9)
        return math.ceil(want * min(per_pick, o.likelihood_max_candidates_per_pick) - 1e-9)

    def _pool(self, want: int, exclude: set[int]) -> tuple[list[int], np.random.Generator]:
        """The candidates of a weighted draw of ``want`` prompts, and the draw's random stream."""
        n = len(self._prompts)
        rng = np.random.default_rng([self.seed, self.draws, _STREAM])
        self.draws += 1
        size = max(self.options.pool, want)
        drawn = rng.choice(n, size=min(n, size + len(exclude)), replace=False).tolist()
        pool = [i for i in drawn if i not in exclude][:size]
        return (pool if len(pool) >= want else drawn), rng  # too few prompts: the explored ones may repeat

    def _weighted(
        self,
        want: int,
        a: np.ndarray,
        b: np.ndarray,
        measured: np.ndarray,
        zero_var: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[list[int], np.ndarray]:
        """Positions in the pool of ``want`` candidates drawn by their weights (Gumbel-top-k), and the
        candidates' log weights."""
        logw = log_weights(a, b, self.selection, self.options, self.group_size, zero_var)
        self._tally.pool += len(a)
        self._tally.pool_zero_var += float(zero_var.sum())
        self._tally.effective.append(effective_number(selection_probabilities(logw)))
        picked: list[int] = []
        while len(picked) < want:  # one pass unless the batch is larger than the pool
            keys = logw + rng.gumbel(size=len(a))
            picked.extend(np.argsort(-keys, kind="stable")[: want - len(picked)].tolist())
        self._note_chosen(a[picked], b[picked], measured[picked], zero_var[picked])
        return picked, logw

    def _note_chosen(self, a: np.ndarray, b: np.ndarray, measured: np.ndarray, zero_var: np.ndarray) -> None:
        t = self._tally
        t.chosen += len(a)
        t.chosen_p += float((a / (a + b)).sum())
        t.chosen_zero_var += float(zero_var.sum())
        t.chosen_measured += int(measured.sum())

    # -- statistics and metrics -----------------------------------------------------------------

    def observe(self, uid: str, values: Sequence[float], step: int) -> None:
        """Record one scored group of prompt ``uid``: its completions' success values in [0, 1]."""
        if uid not in self._index:
            raise KeyError(f"prompt {uid!r} is not one of this selector's prompts")
        self.stats.record(uid, values, step)
        self._tally.groups += 1
        self._tally.zero_var_groups += len(values) > 0 and (min(values) == max(values))

    def metrics(self) -> dict[str, float]:
        """The ``selection/*`` metrics of the draws and observations since the last call; resets them."""
        t, self._tally = self._tally, _StepTally()
        out: dict[str, float] = {"selection/prompts_seen": float(len(self.stats))}
        if t.chosen:
            out["selection/p_est_mean"] = t.chosen_p / t.chosen
            out["selection/measured_frac"] = t.chosen_measured / t.chosen
            expected = t.chosen_zero_var / t.chosen
            out["selection/zero_var_expected"] = expected
            if t.pool:
                uniform = t.pool_zero_var / t.pool
                out["selection/zero_var_expected_uniform"] = uniform
                out["selection/zero_var_avoided"] = uniform - expected
                out["selection/effective_prompts"] = float(np.mean(t.effective))
        if t.groups:
            out["selection/zero_var_frac"] = t.zero_var_groups / t.groups
        if self.uses_likelihood:
            out["selection/scored_prompts"] = float(t.scored)
            out["selection/scoring_s"] = t.scoring_s
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch sampler's state with ``selection``: draws and statistics (a copy later draws leave alone)."""
        state = self.epochs.state_dict()
        state["selection"] = {"draws": self.draws, "stats": self.stats.state_dict()}
        if len(self.candidates):
            state["selection"]["candidates"] = self.candidates.state_dict(self._prompts)
        if self.uses_likelihood:
            state["selection"]["uniform_zero_var"] = self.uniform_zero_var
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``; a checkpoint from before prompt statistics starts them empty."""
        self.epochs.load_state_dict(state)
        saved = state.get("selection") or {}
        self.draws = int(saved.get("draws", 0))
        self.stats = PromptStats(self.options.half_life, self._index)
        self.stats.load_state_dict(saved.get("stats", {}), known=self._index)
        self.candidates = CandidatePool.from_state(saved.get("candidates", {}), self._index)
        self.uniform_zero_var = float(saved.get("uniform_zero_var", 0.5))
        self._tally = _StepTally()
        if self._refs is not None:
            self._slot[self._refs.positions] = -1
        self._refs = None
