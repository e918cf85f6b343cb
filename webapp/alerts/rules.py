"""Health rules for RL runs, evaluated step by step on the metrics the engine ships.

Each rule watches the failure modes RL post-training users report (REFERENCES.md, "What goes
wrong in practice") and that a curve only shows to someone who is looking at it:

========================  ==============================================================
``entropy_collapse``      ``actor/entropy`` below ``fraction`` of its early value: the policy
                          stops exploring and accuracy plateaus (Cui et al. 2025, "The Entropy
                          Mechanism of Reinforcement Learning for Reasoning Language Models":
                          R = -a·exp(H) + b, performance is traded for entropy early).
``reward_up_eval_down``   the training reward keeps rising while held-out accuracy falls from
                          its best: reward hacking or overfitting the training prompts.
``mismatch_kl``           ``rollout/mismatch_kl`` (k3 KL between the rollout engine's and the
                          trainer's log-probs, prime-rl's ``mismatch_kl``) over a threshold: the
                          "off-policy without knowing it" failure of vLLM/FSDP precision gaps.
``staleness``             ``async/staleness_max`` above the run's own ``async.max_staleness``:
                          the bound the user set was not kept.
``non_finite``            a loss or gradient norm arrived as null (the engine sends NaN/inf as
                          null, JSON has neither): the update is poisoned.
``zero_std_groups``       ``frac_reward_zero_std`` over a threshold for several steps in a row:
                          most groups carry no advantage, so steps learn nothing (DAPO, §3.2).
``throughput_drop``       ``perf/throughput`` under ``fraction`` of its early median for several
                          steps in a row: a slow node, a memory leak, swapping.
========================  ==============================================================

A rule fires once when its condition starts to hold and re-arms when it stops holding, so a
run sitting under a threshold raises one alert, not one per step. Rules are pure: the state of
each is a small JSON-able dict kept between ingest batches (``webapp.alerts.monitor``), so the
result is the same whether a run's metrics arrive in one batch or one event at a time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Values = Mapping[str, float]


@dataclass(frozen=True)
class Firing:
    """One alert: what crossed which line at which step."""

    rule: str
    step: int
    seq: int
    metric: str
    value: float | None
    threshold: float | None
    message: str


@dataclass(frozen=True)
class Observation:
    """One metrics event as a rule sees it: the finite values and the names that came as null."""

    step: int
    seq: int
    values: Values
    non_finite: tuple[str, ...] = ()


@dataclass(frozen=True)
class Param:
    """A tunable of a rule: its default and the closed range a setting must fall in."""

    default: float
    low: float
    high: float
    help: str
    integer: bool = False


@dataclass
class Rule:
    """A rule's identity, its parameters and its check; subclasses implement ``check``."""

    name: str = ""
    title: str = ""
    params: dict[str, Param] = field(default_factory=dict)

    def check(self, state: dict[str, Any], obs: Observation, p: Mapping[str, float], run: Mapping[str, Any]):
        """Return ``(holds, metric, value, threshold, message)`` or None when this step says nothing."""
        raise NotImplementedError

    def observe(
        self, state: dict[str, Any], obs: Observation, p: Mapping[str, float], run: Mapping[str, Any]
    ) -> Firing | None:
        """Update ``state`` with one observation; a ``Firing`` when the condition starts to hold."""
        verdict = self.check(state, obs, p, run)
        if verdict is None:
            return None
        holds, metric, value, threshold, message = verdict
        was = state.get("active", False)
        state["active"] = holds
        if holds and not was:
            return Firing(self.name, obs.step, obs.seq, metric, value, threshold, message)
        return None


def _fmt(x: float) -> str:
    return f"{x:.3g}"


class EntropyCollapse(Rule):
    metric = "actor/entropy"

    def __init__(self) -> None:
        super().__init__(
            "entropy_collapse",
            "Entropy collapse",
            {
                "fraction": Param(0.1, 0.0, 1.0, "fires below this fraction of the early entropy"),
                "baseline_steps": Param(5, 1, 1000, "steps averaged for the early entropy", integer=True),
            },
        )

    def check(self, state, obs, p, run):
        value = obs.values.get(self.metric)
        if value is None:
            return None
        early = state.setdefault("early", [])
        if len(early) < p["baseline_steps"]:
            early.append(value)
            return None
        baseline = sum(early) / len(early)
        if baseline <= 0:
            return None
        line = p["fraction"] * baseline
        return (
            value < line,
            self.metric,
            value,
            line,
            f"entropy {_fmt(value)} fell below {p['fraction']:.0%} of its early value {_fmt(baseline)}",
        )


class RewardUpEvalDown(Rule):
    """Held-out accuracy significantly below its best while the training reward went up.

    "Significantly": eval accuracy is a proportion over ``data.eval_size`` prompts, so two evals
    of the same policy differ by sampling alone. The fall must exceed ``z`` standard errors of
    the difference of two proportions, sqrt(p1(1-p1)/n + p2(1-p2)/n), and at least ``drop``.
    On the recorded run (128 eval prompts) accuracy went 0.586 -> 0.523 between steps 10 and 30
    while the reward rose: 1.0 standard error, noise, which a plain 0.05 threshold reported.
    """

    reward = "reward/mean"
    accuracy = "eval/accuracy"

    def __init__(self) -> None:
        super().__init__(
            "reward_up_eval_down",
            "Reward up, eval down",
            {
                "drop": Param(0.05, 0.0, 1.0, "the smallest fall of eval accuracy from its best"),
                "z": Param(2.0, 0.0, 10.0, "standard errors the fall must exceed (0: any fall of drop)"),
                "window": Param(10, 1, 1000, "steps in the training reward's moving average", integer=True),
            },
        )

    def check(self, state, obs, p, run):
        window = int(p["window"])
        recent = state.setdefault("rewards", [])
        if self.reward in obs.values:
            recent.append(obs.values[self.reward])
            del recent[:-window]
        accuracy = obs.values.get(self.accuracy)
        if accuracy is None or not recent:
            return None
        reward_now = sum(recent) / len(recent)
        best = state.get("best")
        if best is None or accuracy >= best[0]:
            state["best"] = [accuracy, reward_now, obs.step]
            return False, self.accuracy, accuracy, None, ""
        best_accuracy, reward_at_best, best_step = best
        n = max(1, int(run.get("eval_size") or 1))
        se = math.sqrt((best_accuracy * (1 - best_accuracy) + accuracy * (1 - accuracy)) / n)
        line = best_accuracy - max(p["drop"], p["z"] * se)
        holds = accuracy <= line and reward_now > reward_at_best
        return (
            holds,
            self.accuracy,
            accuracy,
            line,
            f"eval accuracy {_fmt(accuracy)} is down from {_fmt(best_accuracy)} at step {best_step} "
            f"({(best_accuracy - accuracy) / se if se else math.inf:.1f} standard errors over {n} prompts) "
            f"while the training reward rose from {_fmt(reward_at_best)} to {_fmt(reward_now)}",
        )


class Threshold(Rule):
    """A metric above a fixed line."""

    def __init__(self, name: str, title: str, metric: str, default: float, high: float, what: str) -> None:
        super().__init__(
            name, title, {"threshold": Param(default, 0.0, high, f"fires when {what} is above this")}
        )
        self.metric, self.what = metric, what

    def check(self, state, obs, p, run):
        value = obs.values.get(self.metric)
        if value is None:
            return None
        line = p["threshold"]
        return value > line, self.metric, value, line, f"{self.what} {_fmt(value)} is above {_fmt(line)}"


class Staleness(Rule):
    metric = "async/staleness_max"

    def __init__(self) -> None:
        super().__init__("staleness", "Staleness over its bound", {})

    def check(self, state, obs, p, run):
        value = obs.values.get(self.metric)
        bound = run.get("max_staleness")
        if value is None or bound is None:
            return None
        return (
            value > bound,
            self.metric,
            value,
            float(bound),
            f"a batch {value:.0f} policy versions stale was trained; the run's bound is {bound}",
        )


class NonFinite(Rule):
    watched = ("loss", "grad_norm")
    SEPARATOR = "\n"  # in no watched word: a match in names joined by it is inside one name

    def __init__(self) -> None:
        super().__init__("non_finite", "Non-finite loss or gradient", {})

    def check(self, state, obs, p, run):
        bad = sorted(n for n in obs.non_finite if any(w in n for w in self.watched))
        if not bad:
            # Only a step that reports a loss clears the alert: a metrics event of eval alone says nothing.
            if self.watches(obs.values):
                return False, "", None, None, ""
            return None
        return (
            True,
            bad[0],
            None,
            None,
            f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or infinite",
        )

    def watches(self, names: Iterable[str]) -> bool:
        """Whether a watched word is in one of ``names``: a search of each word in the names joined
        by ``SEPARATOR``, not of each word in each name (a batch of 500 events of 50 metrics made
        50,000 searches, 14 of the rules' 15 ms, issue 19)."""
        joined = self.SEPARATOR.join(names)
        return any(word in joined for word in self.watched)


class Sustained(Rule):
    """A condition that must hold ``patience`` steps in a row before it counts."""

    def sustained(self, state: dict[str, Any], holds: bool, patience: float) -> bool:
        state["streak"] = state.get("streak", 0) + 1 if holds else 0
        return state["streak"] >= patience


class ZeroStdGroups(Sustained):
    metric = "frac_reward_zero_std"

    def __init__(self) -> None:
        super().__init__(
            "zero_std_groups",
            "Groups without signal",
            {
                "threshold": Param(0.9, 0.0, 1.0, "fires when more than this share of groups has one reward"),
                "patience": Param(5, 1, 1000, "steps in a row", integer=True),
            },
        )

    def check(self, state, obs, p, run):
        value = obs.values.get(self.metric)
        if value is None:
            return None
        line = p["threshold"]
        holds = self.sustained(state, value > line, p["patience"])
        return (
            holds,
            self.metric,
            value,
            line,
            f"{value:.0%} of groups had all-equal rewards (no advantage) for {state['streak']} steps in a row",
        )


class ThroughputDrop(Sustained):
    metric = "perf/throughput"

    def __init__(self) -> None:
        super().__init__(
            "throughput_drop",
            "Throughput drop",
            {
                "fraction": Param(0.5, 0.0, 1.0, "fires under this fraction of the early median"),
                "warmup_steps": Param(2, 0, 1000, "first steps ignored (compilation, caches)", integer=True),
                "baseline_steps": Param(
                    5, 1, 1000, "steps after the warm-up in the early median", integer=True
                ),
                "patience": Param(3, 1, 1000, "steps in a row", integer=True),
            },
        )

    def check(self, state, obs, p, run):
        value = obs.values.get(self.metric)
        if value is None:
            return None
        seen = state["seen"] = state.get("seen", 0) + 1
        if seen <= p["warmup_steps"]:
            return None
        early = state.setdefault("early", [])
        if len(early) < p["baseline_steps"]:
            early.append(value)
            return None
        median = statistics.median(early)
        line = p["fraction"] * median
        holds = self.sustained(state, value < line, p["patience"])
        return (
            holds,
            self.metric,
            value,
            line,
            f"throughput {_fmt(value)} tokens/s is under {p['fraction']:.0%} of its early median {_fmt(median)}",
        )


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        EntropyCollapse(),
        RewardUpEvalDown(),
        Threshold(
            "mismatch_kl",
            "Train/inference mismatch",
            "rollout/mismatch_kl",
            # A healthy run sits well under it: the recorded asynchronous DAPO run
            # (tests/webapp/recorded) peaks at 0.013 (step 3, two versions stale, before the
            # importance weights settle) and stays under 0.002 after step 10. A sampler serving
            # other weights than the trainer's (a failed weight sync) is far above.
            0.05,
            100.0,
            "the rollout/trainer KL (k3 per token)",
        ),
        Staleness(),
        NonFinite(),
        ZeroStdGroups(),
        ThroughputDrop(),
    )
}


class SettingsError(ValueError):
    """An alert setting that cannot be used; ``field`` says which, the message says why and how."""

    def __init__(self, field_name: str, problem: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {problem}")


def validate_settings(data: object, where: str = "alerts") -> dict[str, dict[str, Any]]:
    """Check user settings ``{rule: {"enabled": bool, param: number}}``; return them normalised.

    Settings come from the browser or the API: unknown rules or parameters, wrong types and
    values out of range are refused with the field named, never stored.
    """
    if not isinstance(data, Mapping):
        raise SettingsError(where, "must be an object {rule: {parameter: value}}")
    out: dict[str, dict[str, Any]] = {}
    for name, values in data.items():
        rule = RULES.get(name) if isinstance(name, str) else None
        if rule is None:
            raise SettingsError(f"{where}.{name}", f"no such rule; the rules are {', '.join(RULES)}")
        if not isinstance(values, Mapping):
            raise SettingsError(f"{where}.{name}", "must be an object {parameter: value}")
        clean: dict[str, Any] = {}
        for key, value in values.items():
            at = f"{where}.{name}.{key}"
            if key == "enabled":
                if not isinstance(value, bool):
                    raise SettingsError(at, "must be true or false")
                clean[key] = value
                continue
            param = rule.params.get(key) if isinstance(key, str) else None
            if param is None:
                known = ", ".join(["enabled", *rule.params])
                raise SettingsError(at, f"no such parameter; {name} takes {known}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise SettingsError(at, "must be a number")
            if param.integer and value != int(value):
                raise SettingsError(at, "must be a whole number")
            if not param.low <= value <= param.high:
                raise SettingsError(at, f"must be between {_fmt(param.low)} and {_fmt(param.high)}")
            clean[key] = int(value) if param.integer else float(value)
        out[name] = clean
    return out


def effective(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each rule's parameters: the defaults, then each layer of settings (project, then run) over them."""
    out = {
        name: {"enabled": True, **{k: p.default for k, p in rule.params.items()}}
        for name, rule in RULES.items()
    }
    for layer in layers:
        for name, values in layer.items():
            if name in out:
                out[name].update(values)
    return out


def evaluate(
    states: dict[str, dict[str, Any]],
    observations: list[Observation],
    params: Mapping[str, Mapping[str, Any]],
    run: Mapping[str, Any],
) -> list[Firing]:
    """Feed observations in order to every enabled rule; ``states`` is updated in place."""
    fired: list[Firing] = []
    for obs in observations:
        for name, rule in RULES.items():
            if params[name].get("enabled", True):
                firing = rule.observe(states.setdefault(name, {}), obs, params[name], run)
                if firing is not None:
                    fired.append(firing)
    return fired
