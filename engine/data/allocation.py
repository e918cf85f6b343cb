"""Adaptive group size (``rollout.n_schedule: frontier``): how many completions each prompt of a step gets.

A step spends ``B = k x rollout.n`` completions on its k prompts. A fixed schedule gives every prompt
``n``; the frontier schedule spends the same B where it buys the most learning signal, the allocation
idea of DARS ("Depth-Breadth Synergy in RLVR", arXiv:2508.13755: rollouts re-allocated across
prompts by difficulty) and GDRO.

The weight of a prompt of estimated pass rate p is the standard deviation of one completion's
success, sigma = sqrt(p (1 - p)). Spending completions in proportion to sigma is Neyman's optimal
allocation (Neyman 1934, "On the two different aspects of the representative method", JRSS): it
minimises the summed variance of the groups' mean estimates, sum_i sigma_i^2 / n_i, under
sum_i n_i = B, and those means are the baselines every group-relative advantage subtracts. sigma is
largest at p = 1/2 (the frontier) and vanishes for solved (p -> 1) and hopeless (p -> 0) prompts.

Rules, in this order:

* a prompt never measured (no statistics of its own) keeps ``n``: its estimate is a guess;
* the rest share what is left of B; each gets at least ``n_min`` (>= 2: a group of one has no
  baseline, its advantage would be 0) and at most ``n_max``, and otherwise ``lambda x sigma_i``,
  ``lambda`` found by bisection so the clipped values sum to the budget (water-filling);
* the real values are rounded to integers by largest remainder (ties to the earlier prompt), which
  keeps each within [n_min, n_max] and the total exactly B.

p is the Beta posterior mean of the prompt statistics (``engine/data/prompt_stats.py``), never 0 or
1, so every sigma is positive. The allocation is a pure function of the statistics: a resumed run,
whose statistics are restored exactly, allocates exactly as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_BISECTION_STEPS = 200
"""Halvings of the multiplier's bracket: far past float precision (the rounding absorbs the rest)."""


def frontier_weights(p: np.ndarray) -> np.ndarray:
    """sigma = sqrt(p (1 - p)) of each estimated pass rate (see the module docstring)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    return np.sqrt(p * (1.0 - p))


def water_fill(weights: np.ndarray, budget: float, low: int, high: int) -> np.ndarray:
    """Real sizes clip(lambda w_i, low, high) summing to ``budget`` (needs len x low <= budget <= len x high).

    The sum is continuous and non-decreasing in lambda, so bisection finds it; a zero weight gets
    ``low`` (when every weight is zero the budget is spread evenly instead)."""
    k = len(weights)
    if k == 0:
        return np.zeros(0)
    if not k * low <= budget <= k * high:
        raise ValueError(f"cannot allocate {budget} completions to {k} prompts within [{low}, {high}] each")
    w = np.asarray(weights, dtype=np.float64)
    if not np.any(w > 0):
        return np.full(k, budget / k)
    lo, hi = 0.0, high / w[w > 0].min()  # at hi every prompt with a weight is at ``high``
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if np.clip(mid * w, low, high).sum() < budget:
            lo = mid
        else:
            hi = mid
    return np.clip(hi * w, low, high)


def round_to_budget(real: np.ndarray, budget: int, low: int, high: int) -> list[int]:
    """Integers within [low, high] summing exactly to ``budget``, by largest remainder (Hamilton's method):
    floors first, then one more for the largest fractional parts, earlier prompts first on ties."""
    sizes = np.clip(np.floor(real + 1e-9), low, high).astype(int)
    order = sorted(range(len(real)), key=lambda i: (-(real[i] - sizes[i]), i))
    left = budget - int(sizes.sum())
    while left > 0:  # one pass unless float error left a unit more than the remainders
        moved = False
        for i in order:
            if left == 0:
                break
            if sizes[i] < high:
                sizes[i] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError(f"cannot round to {budget} within [{low}, {high}]")
    while left < 0:  # float error the other way: take back from the smallest remainders
        for i in reversed(order):
            if left == 0:
                break
            if sizes[i] > low:
                sizes[i] -= 1
                left += 1
    return [int(s) for s in sizes]


@dataclass(frozen=True)
class Allocation:
    """One round's group sizes, prompt by prompt, and how they compare with the fixed ``n``."""

    sizes: list[int]
    default: int

    @property
    def budget(self) -> int:
        return sum(self.sizes)

    def metrics(self) -> dict[str, float]:
        """``rollout/n_mean``, ``n_min``, ``n_max``, and the groups given more or fewer than ``n``."""
        if not self.sizes:
            return {}
        return {
            "rollout/n_mean": float(np.mean(self.sizes)),
            "rollout/n_min": float(min(self.sizes)),
            "rollout/n_max": float(max(self.sizes)),
            "rollout/n_groups_more": float(sum(s > self.default for s in self.sizes)),
            "rollout/n_groups_fewer": float(sum(s < self.default for s in self.sizes)),
        }


def allocate(p: Sequence[float], measured: Sequence[bool], *, n: int, n_min: int, n_max: int) -> Allocation:
    """Group sizes for prompts of estimated pass rates ``p`` (``measured``: estimated from their own
    statistics), spending exactly ``len(p) x n`` completions (see the module docstring)."""
    if not 2 <= n_min <= n <= n_max:
        raise ValueError(f"need 2 <= n_min <= n <= n_max, got n_min={n_min}, n={n}, n_max={n_max}")
    sizes = [n] * len(p)
    chosen = [i for i, m in enumerate(measured) if m]
    if chosen:
        budget = n * len(chosen)
        weights = frontier_weights(np.asarray([p[i] for i in chosen]))
        real = water_fill(weights, budget, n_min, n_max)
        for i, size in zip(chosen, round_to_budget(real, budget, n_min, n_max), strict=True):
            sizes[i] = size
    assert sum(sizes) == n * len(p) and all(n_min <= s <= n_max for s in sizes)
    return Allocation(sizes, n)


def merge_metrics(allocations: Sequence[Allocation]) -> dict[str, float]:
    """One step's ``rollout/n_*`` metrics over its rounds (dynamic sampling may draw several)."""
    sizes = [s for a in allocations for s in a.sizes]
    if not sizes:
        return {}
    return Allocation(sizes, allocations[0].default).metrics()


def expand(prompt_count: int, sizes: Sequence[int]) -> list[int]:
    """The prompt index of each completion when prompt i is repeated sizes[i] times (generation order)."""
    if len(sizes) != prompt_count:
        raise ValueError(f"{len(sizes)} group sizes for {prompt_count} prompts")
    return [i for i, s in enumerate(sizes) for _ in range(s)]
