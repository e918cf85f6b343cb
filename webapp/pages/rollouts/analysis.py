"""What the rollout browser draws beyond the cards: a step's reward histogram and length-against-reward
scatter (computed here from one query per view, drawn by rollouts.js with uPlot), and a completion's
token view (``extra.tokens`` from the engine: engine/pipeline/token_view.py) shaped for the template."""

from __future__ import annotations

import itertools
import math
from typing import Any

from webapp.runs import selectors
from webapp.runs.models import Run

MAX_POINTS = 5000  # a step holds at most logging.samples_per_step (<= 4096) samples
MAX_BINS = 20
DISCRETE_VALUES = 10
"""At most this many distinct rewards (a 0/1 task, a few graded levels) get one bar each, at the value
itself: equal-width bins would split them arbitrarily and leave empty bars between them."""

# Token colour levels, 0 .. 4 (rollouts.css): log-probability by the probability it stands for
# (0: p < 0.05, the surprising tokens, .. 4: p >= 0.9); entropy in nats (0: under 0.1, all but
# certain, .. 4: 3 or more, ~20 equally likely tokens).
PROBABILITY_LEVELS = (0.05, 0.25, 0.5, 0.9)
ENTROPY_LEVELS = (0.1, 0.5, 1.5, 3.0)
TOKEN_MODES = ("logprob", "entropy")
MAX_TOKENS_SHOWN = 4096  # logging.tokens_per_sample's bound: a stored row can hold no more


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def histogram(values: list[float]) -> dict[str, Any]:
    """Counts of ``values``: one bar per value when there are at most ``DISCRETE_VALUES`` distinct ones,
    else equal-width bins, as many as Sturges' rule gives (``ceil(log2 n) + 1``; Sturges 1926), at most
    ``MAX_BINS``. ``x`` is each bar's centre, ``width`` the bars' width (in reward units)."""
    distinct = sorted(set(values))
    if len(distinct) <= DISCRETE_VALUES:
        counts = {v: 0 for v in distinct}
        for v in values:
            counts[v] += 1
        gaps = [b - a for a, b in itertools.pairwise(distinct)]
        return {"x": distinct, "count": [counts[v] for v in distinct], "width": min(gaps) if gaps else 1.0}
    low, high = distinct[0], distinct[-1]
    bins = min(MAX_BINS, math.ceil(math.log2(len(values))) + 1)
    width = (high - low) / bins
    counts = [0] * bins
    for v in values:
        counts[min(int((v - low) / width), bins - 1)] += 1
    return {"x": [low + (i + 0.5) * width for i in range(bins)], "count": counts, "width": width}


def step_distribution(run: Run, step: int) -> dict[str, Any]:
    """The reward histogram and the (length, reward) points of every sample of ``step`` (whatever the
    search shows): one query for the step's (reward, length) pairs on the ``(run, step)`` index."""
    rows = list(selectors.samples(run, step=step).values_list("reward", "length")[:MAX_POINTS])
    points = sorted(
        (length, reward) for reward, length in ((_finite(r), n) for r, n in rows) if reward is not None
    )
    rewards = [r for _, r in points]
    bars = histogram(rewards) if rewards else None
    # the bars in words, for screen readers (the plot itself is a canvas)
    label = "; ".join(f"{x:.3g}: {c}" for x, c in zip(bars["x"], bars["count"])) if bars else ""
    return {
        "step": step,
        "samples": len(rows),
        "unscored": len(rows) - len(points),
        "histogram": bars,
        "histogram_label": label,
        "scatter": {"length": [n for n, _ in points], "reward": rewards},
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
    }


def _level(value: float, thresholds: tuple[float, ...]) -> int:
    return sum(value >= t for t in thresholds)


def token_view(extra: dict[str, Any]) -> dict[str, Any] | None:
    """``extra.tokens`` as the template's rows of (text, log-prob, probability, entropy, colour levels),
    or None when the sample has none or they are malformed (the engine's shape is in token_view.py;
    anything else a client shipped is ignored rather than shown wrong)."""
    raw = extra.get("tokens")
    if not isinstance(raw, dict):
        return None
    texts, logprobs, entropies = raw.get("text"), raw.get("logprob"), raw.get("entropy")
    if not isinstance(texts, list) or not isinstance(logprobs, list) or len(texts) != len(logprobs):
        return None
    if entropies is not None and (not isinstance(entropies, list) or len(entropies) != len(texts)):
        entropies = None
    tokens = []
    for i, (text, lp) in enumerate(zip(texts[:MAX_TOKENS_SHOWN], logprobs)):
        lp = _finite(lp)
        if not isinstance(text, str) or lp is None or lp > 1e-6:
            return None
        p = math.exp(min(lp, 0.0))
        h = _finite(entropies[i]) if entropies is not None else None
        tokens.append(
            {
                "text": text,
                "logprob": lp,
                "p": p,
                "entropy": h,
                "lp_level": _level(p, PROBABILITY_LEVELS),
                "h_level": _level(h, ENTROPY_LEVELS) if h is not None else "",
            }
        )
    count = raw.get("count")
    count = (
        count
        if isinstance(count, int) and not isinstance(count, bool) and count >= len(tokens)
        else len(tokens)
    )
    return {
        "tokens": tokens,
        "count": count,
        "cut": count > len(tokens),
        "has_entropy": entropies is not None,
    }


def token_legend() -> dict[str, list[str]]:
    """The legend's words for the five colour levels of each mode."""
    p, h = PROBABILITY_LEVELS, ENTROPY_LEVELS
    return {
        "logprob": [f"p < {p[0]}"] + [f"{a} ≤ p < {b}" for a, b in itertools.pairwise(p)] + [f"p ≥ {p[-1]}"],
        "entropy": [f"H < {h[0]}"]
        + [f"{a} ≤ H < {b}" for a, b in itertools.pairwise(h)]
        + [f"H ≥ {h[-1]} nats"],
    }
