"""Pass-rate estimates for prompts never sampled, from similar prompts that were.

DOTS (Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement Fine-tuning Through
Difficulty-targeted Online Data Selection and Rollout Replay", arXiv:2506.05316, section 3.2)
measures the pass rate of a small reference set with rollouts and predicts every other prompt's
as an attention-weighted average of the reference pass rates, the attention scores coming from a
frozen embedding model's similarity between the prompts (plus a light trained adapter). Attention
with fixed keys is Nadaraya-Watson kernel regression (Nadaraya 1964, Watson 1964: the estimate at
x is sum_j K(x, x_j) y_j / sum_j K(x, x_j)), so the cheap equivalent here keeps the estimator and
replaces the learned embedding with one that needs no model and no training:

* **features**: character 1- to 3-grams of the raw prompt, with ``^``/``$`` marking its ends (so
  the first and last characters count, as leading digits do in ``"47+85="``), hashed into
  ``DIM`` buckets with CRC-32 (stable across processes, unlike ``hash()``), counts square-rooted
  and L2-normalised (a Hellinger-style embedding: long prompts do not dominate);
* **kernel**: K(x, x_j) = exp((cos(x, x_j) - 1) / h), 1 for identical prompts, with bandwidth h
  (``data.selection_options.bandwidth``): DOTS' softmax over similarities, up to its normalisation;
* **reference set**: the ``data.selection_options.references`` prompts measured most recently
  (their estimates follow the policy as it learns, where DOTS re-measures a fixed set);
* **estimate**: the kernel-pooled Beta posterior mean

      p(x) = (c m + sum_j K(x, x_j) s_j) / (c + sum_j K(x, x_j) n_j)

  with s_j successes in n_j attempts of reference j, c = a0 + b0 the strength of the Beta(a0, b0)
  prior of ``engine/data/prompt_stats.py`` and m = (a0 + sum_j s_j) / (c + sum_j n_j) the
  references' pooled pass rate (an empirical-Bayes prior mean): neighbours weigh by their
  similarity and by how often they were measured, and a prompt with no similar measured neighbour
  gets the pass rate typical of the data so far.

How well it works here (``bench/selection_predictor.py``): the arithmetic starter policy measured on
800 training prompts (8 completions each), 400 of them given as measured, the other 400 predicted
from their text. With h = 0.1 and the default 256 references the predictions correlate 0.38 with
the measured pass rates (0.42 with all 400; 0.20 at h = 0.05, 0.40 at h = 0.2), and the quarter
predicted nearest 1/2 has a 0.163 chance of a zero-variance group against 0.294 for all of them:
about half as many groups without a learning signal among prompts never sampled. (The absolute
error barely beats predicting the mean, 0.214 against 0.224: n-grams see which digits a sum has,
not its carries; the ranking near 1/2 is what the selection uses.)

Cost: a prompt's features are computed once (a few hundred CRC-32s), an estimate is one
``(candidates x DIM) @ (DIM x references)`` product: about 34 million multiply-adds for 1024
candidates against 256 references.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from engine.data.prompt_stats import PRIOR_A, PRIOR_B, PromptRecord

DIM = 128
"""Hashed feature dimension (the hashing trick keeps inner products in expectation; 512 bytes a prompt)."""
NGRAMS = (1, 2, 3)


def ngram_features(text: str, dim: int = DIM) -> np.ndarray:
    """The hashed, square-rooted, L2-normalised character n-gram vector of ``text`` (length ``dim``)."""
    marked = f"^{text}$"
    vec = np.zeros(dim, dtype=np.float64)
    for n in NGRAMS:
        for i in range(len(marked) - n + 1):
            vec[zlib.crc32(f"{n}:{marked[i : i + n]}".encode()) % dim] += 1.0
    vec = np.sqrt(vec)
    return vec / np.linalg.norm(vec)


class FeatureCache:
    """Features of the training prompts by index (float32), computed the first time each is needed.

    The table is allocated whole but zero-filled memory is only committed as rows are written."""

    def __init__(self, texts: Sequence[str], dim: int = DIM) -> None:
        self._texts = texts
        self._rows = np.zeros((len(texts), dim), dtype=np.float32)
        self._done = np.zeros(len(texts), dtype=bool)

    def matrix(self, indices: Sequence[int]) -> np.ndarray:
        for i in indices:
            if not self._done[i]:
                self._rows[i] = ngram_features(self._texts[i], self._rows.shape[1])
                self._done[i] = True
        return self._rows[list(indices)]


def kernel_estimates(
    candidates: np.ndarray, references: np.ndarray, records: Sequence[PromptRecord], bandwidth: float
) -> np.ndarray:
    """Kernel-pooled posterior means of the pass rate for each row of ``candidates`` (see the module
    docstring); ``references`` holds the features of the measured prompts ``records`` describe."""
    if len(records) == 0 or len(candidates) == 0:
        return np.full(len(candidates), PRIOR_A / (PRIOR_A + PRIOR_B))
    cosine = np.minimum(candidates @ references.T, 1.0)  # unit vectors; float32 rounding may pass 1
    weights = np.exp((cosine - 1.0) / bandwidth)
    evidence = np.array([(r.successes, r.attempts) for r in records], dtype=np.float64)
    strength = PRIOR_A + PRIOR_B
    prior_mean = (PRIOR_A + evidence[:, 0].sum()) / (strength + evidence[:, 1].sum())
    pooled = (weights @ evidence.astype(weights.dtype)).astype(np.float64)  # one product for both sums
    return (strength * prior_mean + pooled[:, 0]) / (strength + pooled[:, 1])
