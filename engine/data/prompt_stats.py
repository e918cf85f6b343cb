"""Per-prompt pass statistics: what the engine has measured of each prompt it sampled.

Every scored group adds its prompt's attempts (completions) and successes, and records the step.
The pass rate p of a prompt is estimated by the Beta posterior under the uniform prior
Beta(1, 1) (Laplace's rule of succession): after s successes in n attempts,

    p | data ~ Beta(a, b),  a = 1 + s,  b = 1 + n - s
    mean = a / (a + b),     std = sqrt(a b / ((a + b)^2 (a + b + 1)))

so a prompt never sampled has mean 1/2 and std 1/sqrt(12), and neither estimate is ever exactly
0 or 1 (which keeps the selection weights finite, ``engine/data/selection.py``). Successes may be
fractional (a reward in [0, 1] where the task has no right/wrong component); the posterior is the
same formula with pseudo-counts.

The table keeps the prompts in the order they were last measured (most recent last): the
difficulty predictor takes its reference set from the end. ``state_dict``/``load_state_dict``
round-trip it exactly (integers, and floats that JSON writes with ``repr``), order included, so
a resumed run estimates, and therefore selects, exactly as an uninterrupted one.

Given the prompts' positions (``PromptStats(half_life, positions)``, as the selection does), the
table also keeps each prompt's own evidence in arrays by position (``own``): a draw reads the
records of its 1,024 candidates with one gather instead of 1,024 lookups and tuple operations
(with the references' lookups by uid, about half of the 4.8 ms a draw took without a fit of rho;
see ``engine/data/selection.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

PRIOR_A = 1.0
"""Beta prior pseudo-successes (uniform prior Beta(1, 1))."""
PRIOR_B = 1.0
"""Beta prior pseudo-failures."""


class PromptRecord(NamedTuple):
    """What is known of one prompt: completions scored, their summed success, the last step seen, and
    with a half-life (``PromptStats``) the same two sums with each group discounted by its age at
    ``last_step``.

    Immutable, and a tuple: a copy of the table shares its records, and JSON writes each as
    ``[attempts, successes, last_step]`` or ``[attempts, successes, last_step, [attempts, successes]]``."""

    attempts: int
    successes: float
    last_step: int
    decayed: tuple[float, float] | None = None  # discounted (attempts, successes); None: no half-life

    def discounted(self, now: int, half_life: int) -> tuple[float, float]:
        """(attempts, successes) with every group weighted 2^(-age / half_life) at step ``now``; the
        totals when ``half_life`` is 0."""
        if not half_life:
            return float(self.attempts), self.successes
        attempts, successes = self.decayed if self.decayed is not None else (self.attempts, self.successes)
        weight = 2.0 ** (-max(0, now - self.last_step) / half_life)
        return attempts * weight, successes * weight

    @property
    def alpha(self) -> float:
        return PRIOR_A + self.successes

    @property
    def beta(self) -> float:
        return PRIOR_B + self.attempts - self.successes

    @property
    def mean(self) -> float:
        """Posterior mean of the pass rate."""
        return beta_mean(self.alpha, self.beta)

    @property
    def std(self) -> float:
        """Posterior standard deviation of the pass rate."""
        return beta_std(self.alpha, self.beta)


def beta_mean(a: float, b: float) -> float:
    return a / (a + b)


def beta_std(a: float, b: float) -> float:
    return math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))


def success_values(values: Iterable[float]) -> list[float]:
    """Scores as successes in [0, 1] (a right/wrong component is 0 or 1 already; other rewards are clipped)."""
    return [min(1.0, max(0.0, float(v))) for v in values]


class PromptStats:
    """The table of :class:`PromptRecord` by prompt uid, most recently measured last.

    With ``half_life`` (steps, ``data.selection_options.half_life``) each record also keeps its sums
    with every group discounted by 2^(-age / half_life), age counted to the record's last step (a
    record chosen every few steps would never look old by its last step alone).

    ``revision`` counts the changes to the table (a record added, a checkpoint loaded): what was
    computed from it, such as the reference set's fit, is current while the revision is.
    ``positions`` (uid -> position among the run's prompts) adds the arrays ``own`` reads."""

    def __init__(self, half_life: int = 0, positions: Mapping[str, int] | None = None) -> None:
        self.half_life = half_life
        self._records: dict[str, PromptRecord] = {}
        self.newest_step = 0  # the latest step any record saw (0 before the first)
        self.revision = 0
        self._positions = positions
        size = 0 if positions is None else len(positions)
        # By position: (successes, attempts) to discount from last_step (the decayed sums with a
        # half-life, else the totals), last_step, and whether measured at all.
        self._evidence = np.zeros((size, 2))
        self._last = np.zeros(size, dtype=np.int64)
        self._measured = np.zeros(size, dtype=bool)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, uid: object) -> bool:
        return uid in self._records

    def get(self, uid: str) -> PromptRecord | None:
        return self._records.get(uid)

    def record(self, uid: str, values: Sequence[float], step: int) -> PromptRecord:
        """Add one scored group of ``uid`` (success values in [0, 1]) seen at ``step``; moves it to the end."""
        old = self._records.pop(uid, None)
        last_step = max(step, old.last_step if old else step)
        decayed = None
        if self.half_life:
            before = old.discounted(last_step, self.half_life) if old else (0.0, 0.0)
            decayed = (before[0] + len(values), before[1] + float(sum(values)))
        new = PromptRecord(
            attempts=(old.attempts if old else 0) + len(values),
            successes=(old.successes if old else 0.0) + float(sum(values)),
            last_step=last_step,
            decayed=decayed,
        )
        self._records[uid] = new
        self.newest_step = max(self.newest_step, new.last_step)
        self.revision += 1
        if self._positions is not None:
            self._place(self._positions[uid], new)
        return new

    def _place(self, i: int, r: PromptRecord) -> None:
        attempts, successes = r.decayed if self.half_life and r.decayed is not None else (r.attempts, r.successes)
        self._evidence[i] = (successes, attempts)
        self._last[i] = r.last_step
        self._measured[i] = True

    def own(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(successes, attempts) of the prompts at positions ``indices`` as ``PromptRecord.discounted``
        gives them at ``newest_step`` (zeros for a prompt never measured), one row each, and whether
        each was measured. Needs ``positions``."""
        evidence = self._evidence[indices]
        if self.half_life:
            age = np.maximum(0, self.newest_step - self._last[indices])
            evidence *= (2.0 ** (-age / self.half_life))[:, None]
        return evidence, self._measured[indices]

    def recent(self, limit: int) -> list[tuple[str, PromptRecord]]:
        """The ``limit`` most recently measured prompts, oldest first."""
        newest = list(itertools.islice(reversed(self._records.items()), limit))
        return newest[::-1]

    def items(self) -> list[tuple[str, PromptRecord]]:
        return list(self._records.items())

    def state_dict(self) -> dict[str, tuple]:
        """``{uid: (attempts, successes, last_step[, (attempts, successes) discounted])}`` in measurement
        order (JSON keeps it): a copy that shares the immutable records, cheap enough to take before every
        batch (the asynchronous loop does)."""
        return {uid: r if r.decayed is not None else r[:3] for uid, r in self._records.items()}

    def load_state_dict(
        self, state: Mapping[str, Sequence[float]], known: Iterable[str] | None = None
    ) -> None:
        """Take back ``state_dict()``; with ``known``, a uid outside it (other data) is an error."""
        allowed = None if known is None else set(known)
        records: dict[str, PromptRecord] = {}
        for uid, (attempts, successes, last_step, *rest) in state.items():
            if allowed is not None and uid not in allowed:
                raise ValueError(
                    f"the checkpoint's prompt statistics name prompt {uid!r}, which is not among this run's "
                    "training prompts; resume with the same data config"
                )
            decayed = (float(rest[0][0]), float(rest[0][1])) if rest and rest[0] is not None else None
            records[uid] = PromptRecord(int(attempts), float(successes), int(last_step), decayed)
        self._records = records
        self.newest_step = max((r.last_step for r in records.values()), default=0)
        self.revision += 1
        if self._positions is not None:
            self._evidence[:] = 0.0
            self._last[:] = 0
            self._measured[:] = False
            for uid, r in records.items():
                self._place(self._positions[uid], r)
