"""The weighted combination of reward functions that scores a step's completions.

``RewardManager`` is built once per run from ``reward.functions`` and called once per step.
Which functions run where:

- Built-ins marked inline (``exact_match``, ``format``, ``overlong``, ``length``, ``task``)
  are plain string and arithmetic checks that finish in microseconds: they run in the
  calling process. Sending them to a process would cost more than computing them (a pipe
  round trip is ~50-100 us), and they cannot hang.
- ``math`` (sympy may take unbounded time) and user functions (anything can happen) run in a
  ``RewardPool`` of ``workers`` processes with the per-call ``timeout_s``. The pool is given
  its work first, and the inline functions are computed while it runs.

A failing call never ends the run: it scores 0.0 for its component and is counted (``errors``
or ``timeouts``, a few distinct messages kept for the log), because one bad completion or one
flaky user function must not cost hours of training. Configuration mistakes, on the contrary,
fail in the constructor, naming the config field.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.rewards.policy import RewardPolicy
from engine.rewards.pool import ERROR, OK, TIMEOUT, RewardPool, describe_error, to_score
from engine.rewards.registry import (
    ItemTuple,
    RewardParamError,
    RewardSpec,
    check_params,
    check_user_ref,
    make_caller,
    resolve_reward,
)
from engine.rewards.sandbox import WorkerLimits

MAX_ERROR_MESSAGES = 5
"""Distinct failure messages kept per ``score`` call: enough to diagnose, bounded for the log."""


class RewardFunctionLike(Protocol):
    """What the manager needs of ``engine.config.RewardFunctionConfig``."""

    name: str
    weight: float
    params: dict[str, Any]


@dataclass
class RewardInput:
    """One completion to score, with everything a reward function may look at.

    ``response_length`` is in tokens, ``max_response_length`` is the generation budget
    (``rollout.max_new_tokens``); ``finish_reason`` is "stop" or "length" (truncated).
    """

    completion: str
    answer: str | None = None
    prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    response_length: int = 0
    max_response_length: int = 0
    finish_reason: str = "stop"

    def as_tuple(self) -> ItemTuple:
        return (
            self.completion,
            self.answer,
            self.prompt,
            self.metadata,
            self.response_length,
            self.max_response_length,
            self.finish_reason,
        )


@dataclass
class RewardResult:
    """Scores of one batch.

    ``total[i]`` is the weighted sum for item i; ``components[name][i]`` the unweighted value of
    each function (0.0 where it failed). ``errors``/``timeouts`` count failed calls over all
    items and components; ``error_messages`` holds a few distinct ones.
    """

    total: list[float]
    components: dict[str, list[float]]
    errors: int = 0
    timeouts: int = 0
    error_messages: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """``reward/<component>/mean`` per component, ``reward/errors``, ``reward/timeouts``."""
        out = {
            f"reward/{name}/mean": (sum(values) / len(values) if values else 0.0)
            for name, values in self.components.items()
        }
        out["reward/errors"] = float(self.errors)
        out["reward/timeouts"] = float(self.timeouts)
        return out


@dataclass(frozen=True)
class _Component:
    name: str  # unique key in RewardResult.components
    spec: RewardSpec
    weight: float
    params: dict[str, Any]


def validate_reward_functions(
    functions: Sequence[RewardFunctionLike], *, import_user: bool = True, policy: RewardPolicy | None = None
) -> None:
    """Check names, weights and params as the manager will; errors name the config field.

    With ``import_user=False`` user functions (``module:function``) are only checked for their
    form and against ``policy`` (default: this process's), not imported: for places that
    validate configs but must not run user code (the web app). Built-ins are always checked fully.
    """
    _components(functions, import_user=import_user, policy=policy)


def _components(
    functions: Sequence[RewardFunctionLike], *, import_user: bool = True, policy: RewardPolicy | None = None
) -> list[_Component]:
    policy = policy or RewardPolicy.from_env()
    components: list[_Component] = []
    taken: set[str] = set()
    for i, fc in enumerate(functions):
        where = f"reward.functions[{i}]"
        weight = fc.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{where}.weight: must be a finite number, got {weight!r}")
        if not import_user and ":" in fc.name:
            try:
                check_user_ref(fc.name)
                policy.check_name(fc.name)
            except ValueError as exc:
                raise ValueError(f"{where}.name: {exc}") from None
            continue
        try:
            spec = resolve_reward(fc.name, policy)
        except ValueError as exc:
            raise ValueError(f"{where}.name: {exc}") from None
        params = dict(fc.params or {})
        try:
            check_params(spec, params)
        except RewardParamError as exc:
            raise ValueError(f"{where}.params.{exc.param}: {exc}") from None
        base = fc.name.rsplit(":", 1)[-1].rsplit(".", 1)[-1]  # "pkg.mod:fn" -> "fn"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        components.append(_Component(name, spec, float(weight), params))
    if not functions:
        raise ValueError("reward.functions: give at least one reward function")
    return components


class RewardManager:
    """Scores completions with weighted reward functions; see the module docstring.

    ``timeout_s`` limits each call of a pooled function; ``workers`` is the number of pool
    processes (started here, only if a function needs the pool). Use as a context manager or
    call ``close()``; workers also exit with the interpreter.
    """

    def __init__(
        self,
        functions: Sequence[RewardFunctionLike],
        *,
        timeout_s: float = 5.0,
        workers: int = 1,
        limits: WorkerLimits | None = None,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"reward.timeout_s: must be a positive number of seconds, got {timeout_s!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"reward.workers: must be a whole number >= 1, got {workers!r}")
        self._components = _components(functions)
        self.timeout_s = float(timeout_s)
        self._inline = [(c, make_caller(c.spec.fn, c.params)) for c in self._components if c.spec.inline]
        self._pooled = [c for c in self._components if not c.spec.inline]
        self._pool: RewardPool | None = None
        if self._pooled:
            self._pool = RewardPool(
                [(c.name, c.spec.ref, c.params) for c in self._pooled],
                timeout_s=self.timeout_s,
                workers=workers,
                limits=limits,
            )
            self._finalizer = weakref.finalize(self, self._pool.close)

    @classmethod
    def from_config(cls, config: Any) -> RewardManager:
        """From an ``engine.config.RewardConfig`` (``functions``, ``timeout_s``, ``workers``, limits)."""
        limits = WorkerLimits(memory_mb=config.worker_memory_mb, cpu_s=config.worker_cpu_s)
        return cls(config.functions, timeout_s=config.timeout_s, workers=config.workers, limits=limits)

    @property
    def component_names(self) -> list[str]:
        """Keys of ``RewardResult.components``, in config order."""
        return [c.name for c in self._components]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the pool workers (empty when every function runs inline)."""
        return self._pool.pids if self._pool is not None else []

    def score(self, items: Sequence[RewardInput]) -> RewardResult:
        """Score every item with every function; never raises because a function failed."""
        tuples = [item.as_tuple() for item in items]
        n = len(tuples)
        values = {c.name: [0.0] * n for c in self._components}
        failures = _Failures()

        def score_inline() -> None:
            for component, call in self._inline:
                column = values[component.name]
                for i, item in enumerate(tuples):
                    try:
                        column[i] = to_score(call(item))
                    except Exception as exc:
                        failures.add(ERROR, describe_error(component.name, exc))

        if self._pool is None:
            score_inline()
        else:
            outcome = self._pool.run(tuples, range(len(self._pooled)), meanwhile=score_inline)
            for f, i, status, value in outcome.results:
                if status == OK:
                    values[self._pooled[f].name][i] = value
                else:
                    failures.add(status, value)
        total = [0.0] * n
        for c in self._components:
            if c.weight:
                column = values[c.name]
                total = [t + c.weight * v for t, v in zip(total, column)]
        return RewardResult(total, values, failures.errors, failures.timeouts, failures.messages)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._finalizer()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Failures:
    __slots__ = ("errors", "messages", "timeouts")

    def __init__(self) -> None:
        self.errors = 0
        self.timeouts = 0
        self.messages: list[str] = []

    def add(self, status: str, message: str) -> None:
        if status == TIMEOUT:
            self.timeouts += 1
        else:
            self.errors += 1
        if len(self.messages) < MAX_ERROR_MESSAGES and message not in self.messages:
            self.messages.append(message)
