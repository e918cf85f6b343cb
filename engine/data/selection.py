"""Which prompts get rollouts (``data.selection``): uniform epochs, or weighted by estimated pass rate.

A group of n completions whose rewards are all equal carries no GRPO gradient (its advantages
are all zero); for a prompt of pass rate p that happens with probability p^n + (1 - p)^n, least at
p = 1/2. Both weighted selections spend the rollouts where that probability is low:

* ``uniform`` (the default): the shuffled epochs of :class:`~engine.data.prompts.PromptSampler`,
  exactly as without this module (the same prompts in the same order, the same random streams);
* ``difficulty_targeted`` (DOTS: Sun et al. 2025, "Improving Data Efficiency for LLM
  Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
  Replay", arXiv:2506.05316): prefer prompts whose estimated pass rate is near 1/2, with weight
  w(p) = exp(-|p - 1/2| / tau), ``tau`` = ``data.selection_options.temperature`` (a softmax over
  the closeness to 1/2; tau -> 0 takes the closest prompts only);
* ``pace`` (PACED): w(p) = p^alpha (1 - p)^beta, ``alpha`` and ``beta`` from
  ``data.selection_options``; alpha = beta = 1 gives p (1 - p), the variance of one completion's
  success, which vanishes with the gradient's signal-to-noise ratio at both extremes.

How a weighted batch of k prompts is drawn:

1. **exploration floor**: m = ceil(explore * k) of them (``data.selection_options.explore``) come
   from the uniform epoch sampler, which draws every prompt once per epoch of N prompts. Two draws
   of a prompt are at most 2N - 1 epoch positions apart, so whatever the weights, any
   ceil((2N - 1) / m) consecutive batches draw every prompt: none starves, and the estimates of
   all of them keep being refreshed;
2. **candidates**: ``data.selection_options.pool`` prompts drawn uniformly without replacement
   (all of them when there are fewer), so a batch costs the same however large the dataset;
3. **estimates**: a measured prompt's Beta posterior mean (``engine/data/prompt_stats.py``); a
   prompt never sampled gets the kernel estimate from the most recently measured prompts
   (``engine/data/similarity.py``, the cheap equivalent of DOTS' attention-based predictor);
4. **draw**: the rest of the batch without replacement with probability proportional to w(p)
   among the candidates, by Gumbel-top-k (the k largest of log w_i + G_i, G_i ~ Gumbel(0, 1), are a
   sample without replacement proportional to w: Kool, van Hoof and Welling 2019, "Stochastic
   Beams and Where to Find Them", ICML), with its own random stream seeded by (trainer.seed, the
   number of batches drawn so far): a resumed run draws what an uninterrupted one would.

Metrics (``selection/*``, per step): ``p_est_mean`` (mean estimated pass rate of the chosen
prompts), ``measured_frac`` (the share of them with statistics of their own, the rest predicted),
``zero_var_frac`` (of the groups scored this step, the share whose completions all succeeded or
all failed), ``zero_var_expected`` (the same predicted from the chosen prompts' estimates,
mean of p^n + (1 - p)^n) and, for the weighted selections, ``zero_var_expected_uniform`` (what a
uniform draw would expect: the mean over the uniformly drawn candidates), ``zero_var_avoided``
(the difference: zero-variance groups avoided per group relative to uniform) and
``effective_prompts`` (exp of the entropy of the selection probabilities over the candidates: how
many prompts the weights effectively spread over). ``prompts_seen`` counts the prompts measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import DataConfig, RunConfig
from engine.config.model_data import SelectionOptions
from engine.data.prompt_stats import PromptStats
from engine.data.prompts import Prompt, PromptSampler
from engine.data.similarity import FeatureCache, kernel_estimates

_STREAM = 0x5E1EC7
"""Salt of the selection's random stream (kept apart from every other seeded stream of the run)."""


def log_weights(p: np.ndarray, selection: str, options: SelectionOptions) -> np.ndarray:
    """log w(p) of the selection (see the module docstring); p in (0, 1), as the estimates always are."""
    if selection == "difficulty_targeted":
        return -np.abs(p - 0.5) / options.temperature
    if selection == "pace":
        return options.alpha * np.log(p) + options.beta * np.log1p(-p)
    return np.zeros_like(p)


def selection_probabilities(logw: np.ndarray) -> np.ndarray:
    """Normalised weights w_i / sum_j w_j, computed stably from log weights."""
    w = np.exp(logw - logw.max())
    return w / w.sum()


def zero_variance_probability(p: np.ndarray, n: int) -> np.ndarray:
    """Chance that n independent completions of pass rate p all succeed or all fail."""
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

    chosen_p: list[float] = field(default_factory=list)
    chosen_measured: list[bool] = field(default_factory=list)
    pool_zero_var: list[float] = field(default_factory=list)  # weighted draws: expected, per candidate
    effective: list[float] = field(default_factory=list)
    groups: int = 0
    zero_var_groups: int = 0


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
        self.stats = PromptStats()
        self.draws = 0  # weighted batches drawn so far: the key of the next one's random stream
        self._features = FeatureCache([p.raw for p in self._prompts])
        self._tally = _StepTally()

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

    # -- estimates ------------------------------------------------------------------------------

    def estimates(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Estimated pass rates of the prompts ``indices`` and whether each was measured itself."""
        p = np.empty(len(indices))
        measured = np.zeros(len(indices), dtype=bool)
        unmeasured: list[int] = []
        for j, i in enumerate(indices):
            record = self.stats.get(self._prompts[i].uid)
            if record is None:
                unmeasured.append(j)
            else:
                p[j], measured[j] = record.mean, True
        if unmeasured:
            refs = self.stats.recent(self.options.references)
            p[unmeasured] = kernel_estimates(
                self._features.matrix([indices[j] for j in unmeasured]),
                self._features.matrix([self._index[uid] for uid, _ in refs]),
                [r for _, r in refs],
                self.options.bandwidth,
            )
        return p, measured

    # -- drawing --------------------------------------------------------------------------------

    def next_batch(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (see the module docstring for how the weighted selections draw)."""
        if self.selection == "uniform":
            batch = self.epochs.next_batch(k)
            self._note_chosen(*self.estimates([self._index[p.uid] for p in batch]))
            return batch
        explored = [
            self._index[p.uid] for p in self.epochs.next_batch(explore_count(k, self.options.explore))
        ]
        self._note_chosen(*self.estimates(explored))
        weighted = self._weighted(k - len(explored), set(explored)) if k > len(explored) else []
        return [self._prompts[i] for i in explored + weighted]

    def _weighted(self, want: int, exclude: set[int]) -> list[int]:
        n = len(self._prompts)
        rng = np.random.default_rng([self.seed, self.draws, _STREAM])
        self.draws += 1
        size = max(self.options.pool, want)
        drawn = rng.choice(n, size=min(n, size + len(exclude)), replace=False)
        pool = [int(i) for i in drawn if int(i) not in exclude][:size]
        if len(pool) < want:  # fewer prompts than the batch needs: the explored ones may repeat
            pool = [int(i) for i in drawn]
        p, measured = self.estimates(pool)
        logw = log_weights(p, self.selection, self.options)
        self._tally.pool_zero_var.extend(zero_variance_probability(p, self.group_size).tolist())
        self._tally.effective.append(effective_number(selection_probabilities(logw)))
        picked: list[int] = []  # positions in the pool
        while len(picked) < want:  # one pass unless the batch is larger than the pool
            keys = logw + rng.gumbel(size=len(pool))
            picked.extend(int(j) for j in np.argsort(-keys, kind="stable")[: want - len(picked)])
        self._note_chosen(p[picked], measured[picked])
        return [pool[j] for j in picked]

    def _note_chosen(self, p: np.ndarray, measured: np.ndarray) -> None:
        self._tally.chosen_p.extend(p.tolist())
        self._tally.chosen_measured.extend(measured.tolist())

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
        if t.chosen_p:
            p = np.array(t.chosen_p)
            out["selection/p_est_mean"] = float(p.mean())
            out["selection/measured_frac"] = float(np.mean(t.chosen_measured))
            expected = float(zero_variance_probability(p, self.group_size).mean())
            out["selection/zero_var_expected"] = expected
            if t.pool_zero_var:
                uniform = float(np.mean(t.pool_zero_var))
                out["selection/zero_var_expected_uniform"] = uniform
                out["selection/zero_var_avoided"] = uniform - expected
                out["selection/effective_prompts"] = float(np.mean(t.effective))
        if t.groups:
            out["selection/zero_var_frac"] = t.zero_var_groups / t.groups
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch sampler's state with ``selection``: draws and statistics (a copy later draws leave alone)."""
        state = self.epochs.state_dict()
        state["selection"] = {"draws": self.draws, "stats": self.stats.state_dict()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``; a checkpoint from before prompt statistics starts them empty."""
        self.epochs.load_state_dict(state)
        saved = state.get("selection") or {}
        self.draws = int(saved.get("draws", 0))
        self.stats = PromptStats()
        self.stats.load_state_dict(saved.get("stats", {}), known=self._index)
        self._tally = _StepTally()
