"""The answer-likelihood predictor of ``data.selection_options.predictor``: the policy's own chance of
writing the reference answer, read as the prompt's pass rate.

Why: ``difficulty_targeted`` selection is only as good as its prediction of which prompts have a pass
rate near 1/2 (``engine/data/selection.py``). The neighbours' kernel over character n-grams
(``engine/data/similarity.py``) sees which digits a sum has, not its carries: on 2,000 arithmetic
prompts measured with 8 completions each, its estimates for a held-out half correlated 0.15-0.22 with
the measured pass rates (a ridge regression on the same features 0.18-0.24). The policy knows better.
One teacher-forced forward gives

    q(x) = P(reference completion + EOS | x) = prod_t softmax(z_t / T)[y_t]

at the rollout temperature T (``RolloutBackend.continuation_logprobs``), the chance that sampling
writes exactly the reference completion: a lower bound of the pass rate, and close to it when a
correct completion is the answer and nothing else. On those 2,000 prompts q correlated 0.80 with the
measured pass rates and its mean was theirs (0.319 against 0.318); the quarter of prompts with q
nearest 1/2 had zero-variance groups 0.014 of the time against 0.18 for all. That is DOTS' idea (Sun
et al. 2025, arXiv:2506.05316: predict a prompt's difficulty before spending rollouts on it) with the
policy as the predictor instead of a separate embedding model and adapter. It suits tasks whose
completions are short answers (the built-in arithmetic task, exact-answer datasets); where the model
reasons before answering, q is the chance of answering at once, far below the pass rate, and the
neighbours' predictor is the one to use.

The predictive of a prompt's pass rate is the Beta of mean q and strength c
(``data.selection_options.likelihood_strength``), updated by the prompt's own record as the neighbours'
predictive is: Beta(c q + s', c (1 - q) + n' - s'). A prompt without a reference answer keeps the
neighbours' predictive.

**What it costs, and the standing pool.** Scoring is a forward over prompt + answer: on the
arithmetic starter (1M parameters, one core) 0.57-0.71 ms a prompt (32, 128 and 256 at once: 20, 72
and 181 ms), against 79 ms to generate a round of 32 prompts x 8 completions (2.5 ms a prompt):
scoring four prompts costs about what one group costs. Scoring a fresh pool of 256 candidates at
every draw (DAPO draws 4-7 times a step), as a first prototype did, cost more than the generation
it saved: in 600-step runs it reached uniform's final accuracy in 12% fewer steps on a third of the
tokens, and took 407-450 s against uniform's 327-356. So scoring follows the picks, and what is
scored is kept: :class:`CandidatePool`. A draw of ``want`` prompts scores c want / (1 - P0) freshly
drawn prompts (c = ``likelihood_candidates_per_pick``, P0 the share of uniformly drawn groups
predicted to have all-equal rewards, from the last fresh candidates), in one call with the
exploration floor's prompts: about c candidates a pick that carry a learning signal, so few early in
a run (most prompts have one) and many once most are solved, where the generation they save is
largest. It picks by weight among them and the candidates earlier draws left, and keeps the best
``pool`` of the rest (by weight) for the next draws, each for at most ``likelihood_max_age`` policy
versions after it was scored. The default, 0, reuses a score only under the weights that gave it,
i.e. in DAPO's later rounds of the same step, which want fewer prompts (``round_size: deficit``).
A lifetime of 8 versions let the best leftovers, scored near 1/2 while the policy kept improving on
them, crowd the picks: at lr 2e-4 (seed 0) 0.855 eval accuracy at step 300 against 0.871 with 0.

Where the device multiplies bfloat16 natively (CPUs with AVX512-BF16 or AMX, CUDA GPUs) the torch
backend scores under bf16 autocast (``likelihood_precision: auto``, the default): on the starter, one
core of an AMD EPYC with AVX512-BF16, 128 prompts took 20 ms against 43, and the scores correlated
0.9999 with float32's (mean |d log q| 0.015, at most 0.045 in q).

The pool is saved with the selection's state (uids, the versions they were scored at, their
scores), so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine.data.prompts import Prompt, encode_texts
from engine.system_metrics import PHASE

if TYPE_CHECKING:
    from engine.config import RunConfig

Q_FLOOR = 1e-12
"""Scores are clipped into [Q_FLOOR, 1 - Q_FLOOR]: a Beta needs both parameters positive (exp of a
log-prob below -745 is 0 in float64), and a chance of 1e-12 is as good as 0 to a group of a few
completions."""


class ContinuationScorer(Protocol):
    """What the pool needs of a rollout backend (``engine/rollout/base.py``)."""

    @property
    def policy_version(self) -> int: ...

    def continuation_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        temperature: float = 1.0,
        *,
        reduced_precision: bool = False,
    ) -> list[float]: ...


def reference_completion(prompt: Prompt) -> str | None:
    """The completion a correct policy writes for ``prompt``: the built-in task's reference completion
    (``Task.reference_completion``) when the prompt is one of a task's, else its reference answer;
    None when it has none."""
    task = prompt.metadata.get("task") if prompt.metadata else None
    if task is not None and prompt.answer is not None:
        from engine.data.tasks import get_task

        try:
            return get_task(str(task)).reference_completion(prompt.answer, prompt.metadata)
        except (KeyError, ValueError):
            return prompt.answer
    return prompt.answer


class AnswerScorer:
    """q(x) of prompts (see the module docstring) from a rollout backend.

    The reference completions are tokenised once per prompt, followed by the tokenizer's EOS token (a
    correct completion stops there, as the starter policy was taught: ``engine/models/starter.py``).
    ``temperature`` is the rollout's (1 when the rollouts are greedy: a greedy policy has no
    distribution). ``reduced_precision`` lets the backend score in bfloat16 where its device does that
    natively (``data.selection_options.likelihood_precision: auto``): a score is an estimate of a
    pass rate, and ~1e-2 in its log is far inside that estimate's own error (q correlated 0.80 with
    measured pass rates, 0.9999 with its bf16 self)."""

    def __init__(
        self, backend: ContinuationScorer, tokenizer: Any, temperature: float, *, reduced_precision: bool = False
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.temperature = float(temperature) if temperature > 0 else 1.0
        self.reduced_precision = bool(reduced_precision)
        self._eos = tokenizer.eos_token_id
        self._ids: dict[str, list[int] | None] = {}

    @classmethod
    def for_run(cls, backend: ContinuationScorer, tokenizer: Any, cfg: RunConfig) -> AnswerScorer:
        """The scorer of a run: at its rollout temperature, in bfloat16 where
        ``data.selection_options.likelihood_precision`` is ``auto`` and the device has it natively."""
        precision = cfg.data.selection_options.likelihood_precision
        return cls(backend, tokenizer, cfg.rollout.temperature, reduced_precision=precision == "auto")

    @property
    def version(self) -> int:
        return int(self.backend.policy_version)

    def continuations(self, prompts: Sequence[Prompt]) -> list[list[int] | None]:
        """The token ids each prompt is scored on (None: no reference answer), tokenised on first use."""
        new = [p for p in prompts if p.uid not in self._ids]
        if new:
            texts = [reference_completion(p) for p in new]
            have = [i for i, t in enumerate(texts) if t]
            encoded = encode_texts(self.tokenizer, [texts[i] for i in have], add_special_tokens=False)
            for p in new:
                self._ids[p.uid] = None
            for i, ids in zip(have, encoded, strict=True):
                self._ids[new[i].uid] = [*ids, self._eos] if self._eos is not None else list(ids)
        return [self._ids[p.uid] for p in prompts]

    def __call__(self, prompts: Sequence[Prompt]) -> np.ndarray:
        """q of each prompt, NaN for a prompt without a reference answer (one backend call for the rest)."""
        continuations = self.continuations(prompts)
        out = np.full(len(prompts), np.nan)
        have = [i for i, c in enumerate(continuations) if c and prompts[i].token_ids]
        if have:
            with PHASE("generate"):  # a forward on the rollout backend's weights, memory as generation's
                logprobs = self.backend.continuation_logprobs(
                    [prompts[i].token_ids for i in have],
                    [continuations[i] for i in have],
                    self.temperature,
                    reduced_precision=self.reduced_precision,
                )
            out[have] = np.clip(np.exp(np.asarray(logprobs, dtype=np.float64)), Q_FLOOR, 1.0 - Q_FLOOR)
        return out


def likelihood_beta(q: np.ndarray, strength: float) -> tuple[np.ndarray, np.ndarray]:
    """The Beta(c q, c (1 - q)) prior of pass rates scored ``q`` (c = ``strength``)."""
    return strength * q, strength * (1.0 - q)


class CandidatePool:
    """The standing candidates of answer-likelihood selection (see the module docstring): prompt
    positions, the policy version each was scored at, and its score (NaN: no answer to score)."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.versions: list[int] = []
        self.scores: list[float] = []

    def __len__(self) -> int:
        return len(self.positions)

    def expire(self, version: int, max_age: int) -> int:
        """Drop the candidates scored more than ``max_age`` versions before ``version``; how many left."""
        keep = [i for i, v in enumerate(self.versions) if version - v <= max_age]
        dropped = len(self.positions) - len(keep)
        if dropped:
            self._keep(keep)
        return dropped

    def remove(self, positions: set[int]) -> None:
        """Take the candidates at these prompt positions out (picked, or drawn by the exploration floor)."""
        if positions.intersection(self.positions):
            self._keep([i for i, p in enumerate(self.positions) if p not in positions])

    def add(self, positions: Sequence[int], version: int, scores: np.ndarray) -> None:
        self.positions.extend(int(p) for p in positions)
        self.versions.extend([int(version)] * len(positions))
        self.scores.extend(float(s) for s in scores)

    def keep_best(self, logw: np.ndarray, picked: set[int], size: int) -> None:
        """After a draw: the candidates at rows ``picked`` leave (they are in the batch), and of the
        rest the ``size`` of highest weight (``logw``, one per row; ties by row) stay."""
        rest = [i for i in range(len(self.positions)) if i not in picked]
        if len(rest) > size:
            order = np.argsort(-logw[rest], kind="stable")[:size]
            rest = sorted(rest[i] for i in order)
        self._keep(rest)

    def _keep(self, rows: list[int]) -> None:
        self.positions = [self.positions[i] for i in rows]
        self.versions = [self.versions[i] for i in rows]
        self.scores = [self.scores[i] for i in rows]

    def state_dict(self, prompts: Sequence[Prompt]) -> dict[str, list]:
        """By uid (stable across a reload of the data); scores as floats, which JSON round-trips
        exactly (NaN as null)."""
        return {
            "uids": [prompts[p].uid for p in self.positions],
            "versions": list(self.versions),
            "scores": [None if math.isnan(s) else s for s in self.scores],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], index: Mapping[str, int]) -> CandidatePool:
        """The saved pool; candidates no longer among the prompts are dropped."""
        pool = cls()
        for uid, version, score in zip(state.get("uids", []), state.get("versions", []), state.get("scores", [])):
            if uid in index:
                pool.positions.append(index[uid])
                pool.versions.append(int(version))
                pool.scores.append(float("nan") if score is None else float(score))
        return pool
