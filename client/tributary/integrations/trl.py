"""TRL and transformers trainers in Tributary: ``TributaryCallback``.

    from tributary.integrations.trl import TributaryCallback

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    TributaryCallback.attach(trainer, project="my-project", name="grpo-qwen")
    trainer.train()

Every ``log`` call of the trainer becomes a metrics event at ``state.global_step``, with TRL's
names mapped to the panels of the run page (``tributary.integrations.names.trl_name``: ``reward``
-> ``reward/mean``, ``kl`` -> ``actor/kl_loss``, ``completions/mean_length`` ->
``response_length/mean``, ...; names it does not know pass through). For ``GRPOTrainer`` (and
its relatives that keep the same ``_logs`` table: the prompts, completions, per-function
rewards and advantages of the latest generation batch, which TRL 1.16 prints and sends to W&B
as its completions table) the callback also sends the completions generated since the last
log as samples, in their groups: TRL's generation batch holds ``num_generations`` completions
of each prompt one after the other (its ``RepeatSampler``), the same groups its advantages are
computed over. A sample's reward is TRL's: the reward functions' values weighted by
``reward_weights``, summed over the functions that scored it (``nansum``); the components are
the functions' own values.

Cancel on the run's page stops training (``control.should_training_stop``); the callback then
finishes the run as cancelled. It finishes a run it started itself at the end of training; a
run passed in is left to its owner. Only the main process (``state.is_world_process_zero``)
reports.

Importing this module imports transformers; ``import tributary`` does not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from transformers import TrainerCallback

import tributary
from tributary.integrations.names import trl_name


class TributaryCallback(TrainerCallback):
    """Reports a transformers/TRL trainer's logs (and GRPO's completions) to a Tributary run.

    ``run``: a ``tributary.Run`` to report to; without one, the callback starts a run at the
    beginning of training with ``tributary.init(**init_kwargs)`` (``project=`` at least; the
    trainer's arguments become the run's config unless ``config=`` is given). ``trainer``: the
    trainer whose completions to send as samples (``attach`` sets it); ``samples=False`` sends
    metrics only."""

    def __init__(
        self, run: Any = None, *, trainer: Any = None, samples: bool = True, **init_kwargs: Any
    ) -> None:
        if run is None and "project" not in init_kwargs:
            raise ValueError(
                "TributaryCallback needs a run, or project= (and other tributary.init arguments)"
            )
        self.run = run
        self.trainer = trainer
        self.samples = samples
        self._own = run is None
        self._init_kwargs = init_kwargs
        self._stopped = False
        self._shipped: list[Any] = []  # the advantage objects of samples already sent (see _new_samples)
        self._shipped_ids: set[tuple[int, Any, Any]] = set()

    @classmethod
    def attach(cls, trainer: Any, run: Any = None, **kwargs: Any) -> TributaryCallback:
        """A callback reporting ``trainer``, added to it."""
        callback = cls(run, trainer=trainer, **kwargs)
        trainer.add_callback(callback)
        return callback

    # ------------------------------------------------------------------ the trainer's events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None and state.is_world_process_zero:
            options = dict(self._init_kwargs)
            if "config" not in options:
                options["config"] = _config(args)
            self.run = tributary.init(**options)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if self.run is None or not state.is_world_process_zero:
            return
        if logs:
            self.run.log({trl_name(str(name)): value for name, value in logs.items()}, step=state.global_step)
        if self.samples and self.trainer is not None:
            items = self._new_samples(state.global_step)
            if items:
                self.run.log_samples(items, step=state.global_step)
        self._honour_cancel(control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None and state.is_world_process_zero:
            self._honour_cancel(control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None and self._own and state.is_world_process_zero:
            if self._stopped:
                self.run.finish("cancelled", f"cancelled from the web app at step {state.global_step}")
            else:
                self.run.finish("succeeded", f"trained {state.global_step} steps")

    def _honour_cancel(self, control: Any) -> None:
        if self.run.should_stop():
            if not self._stopped:
                self.run.log_text(
                    "cancel requested from the web app: training stops after this step", "warning"
                )
            self._stopped = True
            control.should_training_stop = True

    # ------------------------------------------------------------------ GRPO's completions

    def _new_samples(self, step: int) -> list[dict[str, Any]]:
        """The completions in the trainer's ``_logs`` not sent yet, as grouped samples.

        ``_logs`` keeps the latest generation batch (deques of ``generation_batch_size``) and is
        not cleared by a log call, so the same batch can be seen by several logs. A row is told
        by its advantage's identity (a fresh float object from ``tensor.tolist()``; holding the
        ones already sent keeps their ids from being reused) with its prompt and completion: a
        trainer that logs no advantages (all None, one object) is told apart by the text."""
        logs = getattr(self.trainer, "_logs", None)
        if not isinstance(logs, Mapping) or not logs.get("completion"):
            return []
        prompts = list(logs["prompt"])
        completions = list(logs["completion"])
        advantages = list(logs.get("advantages") or [None] * len(completions))
        rewards = {name: list(values) for name, values in (logs.get("rewards") or {}).items()}
        extra_columns = {name: list(values) for name, values in (logs.get("extra") or {}).items()}
        if not (len(prompts) == len(completions) == len(advantages)):
            return []
        keys = [(id(a), p, c) for a, p, c in zip(advantages, prompts, completions)]
        new = [i for i, key in enumerate(keys) if key not in self._shipped_ids]
        if not new:
            return []
        self._shipped = advantages
        self._shipped_ids = set(keys)
        weights = _weights(self.trainer, list(rewards))
        per_group = max(1, int(getattr(self.trainer, "num_generations", 1) or 1))
        first = new[0]
        items = []
        for i in new:
            components = {name: float(values[i]) for name, values in rewards.items() if _finite(values[i])}
            scored = [weights[name] * value for name, value in components.items()]
            item: dict[str, Any] = {
                "prompt": _text(prompts[i]),
                "completion": _text(completions[i]),
                "reward": math.fsum(scored) if scored else None,
                "advantage": advantages[i],
                "components": components,
                "group": f"{step}:{(i - first) // per_group}",
            }
            for name, values in extra_columns.items():
                if i < len(values) and name not in item:
                    item[name] = values[i]
            items.append(item)
        return items


def _weights(trainer: Any, names: list[str]) -> dict[str, float]:
    """The trainer's ``reward_weights`` by reward function name (1 where it has none)."""
    weights = getattr(trainer, "reward_weights", None)
    order = list(getattr(trainer, "reward_func_names", []) or [])
    try:
        values = [float(w) for w in weights.tolist()] if weights is not None else []
    except (AttributeError, TypeError, ValueError):
        values = []
    known = dict(zip(order, values))
    return {name: known.get(name, 1.0) for name in names}


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _text(value: Any) -> str:
    """A prompt or completion as text: plain text as is, a conversation (TRL's conversational
    format: a list of ``{"role", "content"}`` messages) one ``role: content`` line per message,
    a completion of one assistant message as its content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        if len(value) == 1 and value[0].get("role") == "assistant":
            return _content(value[0].get("content"))
        return "\n".join(f"{m.get('role', '?')}: {_content(m.get('content'))}" for m in value)
    return str(value)


def _content(content: Any) -> str:
    if isinstance(content, list):  # multimodal parts: keep the text ones
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return "" if content is None else str(content)


def _config(args: Any) -> dict[str, Any]:
    """The trainer's arguments as the run's config (what ``TrainingArguments.to_dict`` gives)."""
    try:
        return {"trainer": type(args).__name__, **args.to_dict()}
    except Exception:
        return {"trainer": type(args).__name__}
