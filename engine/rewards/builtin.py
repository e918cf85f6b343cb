"""The built-in reward functions: math answers, exact match, format, length, overlong, task.

All follow the calling convention of ``engine.rewards.registry`` and take ``**_`` so that new
input fields never break them. Only ``math`` runs in the worker pool: sympy can take
unbounded time on adversarial expressions. The others are cheap string or arithmetic checks
and run inline in the calling process (see ``RewardManager``).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from numbers import Real
from typing import Any

from engine.rewards.registry import RewardParamError, register_reward

# ----------------------------------------------------------------------------- math


class _DropTimeoutWarning(logging.Filter):
    """math-verify warns once per process that we disabled its timeouts: we did, on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutWarning())
    return math_verify


def _warm_up_math() -> None:
    """Import sympy and compile math-verify's regexes before the first timed call (~0.2 s)."""
    mv = _math_verify()
    mv.verify(_parse_gold("1/2"), _parse("\\boxed{0.5}"), timeout_seconds=None)


def _parse(text: str) -> list[Any]:
    # Timeouts off: math-verify's own use signal.alarm (main thread only); the worker pool
    # enforces reward.timeout_s around the whole call instead.
    return _math_verify().parse(text, parsing_timeout=None)


_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+(\{[^{}]*\})?")
_BARE_WORD = re.compile(r"[A-Za-z]{3,}")


@functools.lru_cache(maxsize=8192)
def _parse_gold(answer: str) -> list[Any]:
    """Parse a reference answer; cached because every completion of a group shares it.

    Answers that carry ``$``, ``\\(`` or ``\\boxed`` are parsed as written. Other answers are
    read as LaTeX math (math-verify needs ``$...$`` to parse ``\\sqrt{8}``, ``(1, 2)`` or
    ``2xy``) unless they contain a bare word: as math, "yes" would become the product y*e*s
    and equal "sey". Such text answers get math-verify's plain extraction, usually nothing,
    which ``math_reward`` reports (exact_match is the reward for text answers).
    """
    text = answer.strip()
    if any(mark in text for mark in ("$", "\\(", "\\[", "\\boxed")):
        return _parse(text)
    if _BARE_WORD.search(_LATEX_COMMAND.sub(" ", text)):
        return _parse(text)
    return _parse(f"${text}$") or _parse(text)


_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: the completion was cut off inside the box


def extract_prediction(completion: str) -> list[Any]:
    """What the completion answers, parsed by math-verify; [] if it gives no answer.

    Models state answers in several ways, tried from most to least explicit: the last
    ``\\boxed{}`` (only the last: a chain of thought may box intermediate results), the last
    ``$...$`` / ``\\(...\\)`` / ``\\[...\\]`` span, math-verify's own extraction from the
    whole text (which prefers "the answer is X" and takes the last expression), then the last
    number.
    """
    boxed = _last_boxed(completion)
    if boxed is not None:
        parsed = _parse(f"\\boxed{{{boxed}}}")
        if parsed:
            return parsed
    spans = list(_MATH_SPAN.finditer(completion))
    if spans:
        parsed = _parse(spans[-1].group(0))
        if parsed:
            return parsed
    parsed = _parse(completion)
    if parsed:
        return parsed
    numbers = _NUMBER.findall(completion)
    return _parse(numbers[-1]) if numbers else []


@register_reward("math", warmup=_warm_up_math)
def math_reward(completion: str, *, answer: str | None = None, **_: Any) -> float:
    """1.0 if the completion's answer is mathematically equal to ``answer``, else 0.0.

    Equality is math-verify's (``\\boxed{1/2}`` equals "0.5", ``2\\sqrt{2}`` equals
    ``\\sqrt{8}``). A completion without a recognisable answer scores 0; a reference answer
    math-verify cannot parse is an error (a data problem worth seeing in the log).
    """
    if answer is None:
        raise ValueError("the 'math' reward needs a reference answer: set data.fields.answer")
    gold = _parse_gold(str(answer))
    if not gold:
        raise ValueError(
            f"math-verify cannot parse the reference answer {answer!r}; use exact_match for text answers"
        )
    predicted = extract_prediction(completion)
    if not predicted:
        return 0.0
    return 1.0 if _math_verify().verify(gold, predicted, timeout_seconds=None) else 0.0


# ----------------------------------------------------------------------------- strings

_SPACES = re.compile(r"\s+")


def _normalise(text: str, ignore_case: bool) -> str:
    text = _SPACES.sub(" ", text.strip())
    return text.casefold() if ignore_case else text


def _require_bool(params: dict[str, Any], *names: str) -> None:
    for name in names:
        if name in params and not isinstance(params[name], bool):
            raise RewardParamError(name, f"must be true or false, got {params[name]!r}")


def _check_exact_match(params: dict[str, Any]) -> None:
    _require_bool(params, "ignore_case", "first_line")


@register_reward("exact_match", inline=True, check=_check_exact_match)
def exact_match(
    completion: str,
    *,
    answer: str | None = None,
    ignore_case: bool = False,
    first_line: bool = False,
    **_: Any,
) -> float:
    """1.0 if the completion equals ``answer`` up to surrounding and repeated whitespace.

    ``ignore_case`` compares case-folded strings; ``first_line`` compares only the first
    non-blank line of the completion (for models that explain after answering).
    """
    if answer is None:
        raise ValueError("the 'exact_match' reward needs a reference answer: set data.fields.answer")
    text = completion.strip()
    if first_line:
        text = text.split("\n", 1)[0]
    return 1.0 if _normalise(text, ignore_case) == _normalise(str(answer), ignore_case) else 0.0


_FORMAT_MODES = ("search", "fullmatch")


@functools.lru_cache(maxsize=64)
def _compile(regex: str, dotall: bool) -> re.Pattern[str]:
    return re.compile(regex, re.DOTALL if dotall else 0)


def _check_format(params: dict[str, Any]) -> None:
    regex = params.get("regex")
    if not isinstance(regex, str):
        raise RewardParamError("regex", f"must be a regular expression string, got {regex!r}")
    _require_bool(params, "dotall")
    try:
        _compile(regex, params.get("dotall", True))
    except re.error as exc:
        raise RewardParamError("regex", f"not a valid regular expression ({exc})") from None
    mode = params.get("mode", "search")
    if mode not in _FORMAT_MODES:
        raise RewardParamError("mode", f"must be one of {', '.join(_FORMAT_MODES)}, got {mode!r}")


@register_reward("format", inline=True, check=_check_format)
def format_reward(
    completion: str, *, regex: str, mode: str = "search", dotall: bool = True, **_: Any
) -> float:
    """1.0 if the completion has the required format, else 0.0.

    ``mode="search"``: ``regex`` occurs anywhere; ``mode="fullmatch"``: the whole completion,
    stripped of surrounding whitespace, matches. ``dotall`` (default on) lets ``.`` cross line
    breaks, which multi-line formats like ``<think>.*</think>`` need. It runs in the training
    process without a timeout (it is a hot path): avoid nested quantifiers such as ``(a+)+``,
    which can backtrack for minutes on a long completion.
    """
    pattern = _compile(regex, dotall)
    if mode == "fullmatch":
        return 1.0 if pattern.fullmatch(completion.strip()) else 0.0
    return 1.0 if pattern.search(completion) else 0.0


# ----------------------------------------------------------------------------- length


def _require_number(params: dict[str, Any], name: str) -> None:
    value = params.get(name)
    if name in params and (
        isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value)
    ):
        raise RewardParamError(name, f"must be a finite number, got {value!r}")


def _check_overlong(params: dict[str, Any]) -> None:
    buffer_len = params.get("buffer_len")
    if buffer_len is not None and (
        isinstance(buffer_len, bool) or not isinstance(buffer_len, int) or buffer_len < 1
    ):
        raise RewardParamError("buffer_len", f"must be a whole number of tokens >= 1, got {buffer_len!r}")
    _require_number(params, "penalty_factor")


def _lengths(response_length: int, max_response_length: int, name: str) -> tuple[int, int]:
    if max_response_length <= 0:
        raise ValueError(f"the '{name}' reward needs max_response_length > 0, got {max_response_length}")
    return response_length, max_response_length


@register_reward("overlong", inline=True, check=_check_overlong)
def overlong_penalty(
    completion: str,
    *,
    response_length: int,
    max_response_length: int,
    buffer_len: int | None = None,
    penalty_factor: float = 1.0,
    **_: Any,
) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    With L the response length, L_max = ``max_response_length`` and L_cache = ``buffer_len``::

        0                                if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        -1                               if L > L_max

    times ``penalty_factor``. A hard cut-off at L_max punishes a sound answer that merely ran
    long as much as a wrong one; the linear ramp inside the last L_cache tokens tells the policy
    "shorter" gradually. ``buffer_len`` defaults to L_max // 5 (DAPO: 4096 of 20480).
    """
    length, max_length = _lengths(response_length, max_response_length, "overlong")
    cache = buffer_len if buffer_len is not None else max(1, max_length // 5)
    if length <= max_length - cache:
        penalty = 0.0
    elif length <= max_length:
        penalty = (max_length - cache - length) / cache
    else:
        penalty = -1.0
    return penalty * penalty_factor


def _check_length(params: dict[str, Any]) -> None:
    _require_number(params, "coef")


@register_reward("length", inline=True, check=_check_length)
def length_reward(
    completion: str, *, response_length: int, max_response_length: int, coef: float = -1.0, **_: Any
) -> float:
    """``coef * response_length / max_response_length``: a penalty (coef < 0) or bonus (coef > 0).

    Linear in the fraction of the budget used, so its scale does not depend on the budget.
    """
    length, max_length = _lengths(response_length, max_response_length, "length")
    return coef * length / max_length


# ----------------------------------------------------------------------------- task


@register_reward("task", inline=True)
def task_reward(
    completion: str, *, answer: str | None = None, metadata: dict[str, Any] | None = None, **_: Any
) -> float:
    """The built-in task's own verifier (``engine.data``), e.g. exact arithmetic results.

    Only prompts of built-in tasks carry ``metadata["task"]``; file datasets have no verifier
    of their own.
    """
    name = (metadata or {}).get("task")
    if not name:
        raise ValueError("the 'task' reward needs a built-in task; use math or exact_match for file datasets")
    from engine.data import get_task

    return get_task(name).score(completion, answer, metadata)
