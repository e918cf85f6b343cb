"""Evaluation and forgetting of a run with ``data.stages`` (continual training, ``engine/config/stages.py``).

At an eval point of step s, every stage seen so far (stages 0..i, stage i the one training step s;
step 0 counts as the first stage's) is evaluated on its own held-out prompts with its own reward, as
``evaluate`` does for a run of one stage, and its metrics are named after it:
``eval/<stage>/accuracy``, ``eval/<stage>/reward``, ... ``eval/accuracy`` (and each other ``eval/*``)
is the mean over the stages evaluated, so the progress bar and the runs table keep one number.

Forgetting (Chaudhry et al. 2018, "Riemannian Walk for Incremental Learning", ECCV, eq. 5; the
continual-learning accuracy matrix of Lopez-Paz and Ranzato 2017): for a stage j evaluated at step s,

    forgetting/<j>(s) = max over earlier eval points t <= s of acc_j(t)  -  acc_j(s)   (>= 0)

and ``forgetting/mean`` is its mean over the stages before the current one (the stage being trained
is learning, not forgetting; absent in the first stage). The best accuracies so far are part of the
checkpoint (``state_dict``), so a resumed run reports the forgetting an uninterrupted one would.

``data.stage_reference: previous_stage`` (:class:`StageReference`): at the first step of every stage
after the first, before anything of that step is computed, the KL term's frozen reference policy
becomes a copy of the policy as the previous stage left it, so the KL penalty (in the loss or the
reward) keeps the policy near what it had learnt rather than near the starting model: the KL
regulariser of continual RL, with the previous task's policy as the anchor (as in the
"policy consolidation" family; RECAP, arXiv:2510.21978, discusses it next to replay). The snapshot is
written with every checkpoint taken after it (``stage_reference.safetensors``), so a resume inside a
stage gets the same reference back; a resume right at a boundary makes the snapshot itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import load_model, save_model

from engine.data.stages import Stage
from engine.pipeline.evaluate import evaluate
from engine.pipeline.producer import RolloutProducer


def stage_of_step(stages: Sequence[Stage], step: int) -> int:
    """Index of the stage training ``step`` (0 for step 0; the last stage past the end)."""
    for s in stages:
        if step <= s.last:
            return s.index
    return len(stages) - 1


def forgetting(best: Mapping[str, float], now: Mapping[str, float], earlier: Sequence[str]) -> dict[str, float]:
    """``forgetting/<stage>`` for every stage in ``now`` (best so far, ``now`` included, minus now) and
    ``forgetting/mean`` over the stages of ``earlier`` that were evaluated (none: no mean)."""
    out = {f"forgetting/{name}": max(best.get(name, acc), acc) - acc for name, acc in now.items()}
    values = [out[f"forgetting/{name}"] for name in earlier if name in now]
    if values:
        out["forgetting/mean"] = float(np.mean(values))
    return out


class StageReference:
    """The KL reference of ``data.stage_reference: previous_stage`` (see the module docstring).

    ``trainer`` is a trainer whose frozen reference policy is ``trainer.reference`` and whose policy is
    ``trainer.model`` (the torch trainer; the config refuses the option with DeepSpeed)."""

    FILE = "stage_reference.safetensors"

    def __init__(self, stages: Sequence[Stage], trainer: Any) -> None:
        if getattr(trainer, "reference", None) is None:
            raise ValueError(
                "data.stage_reference 'previous_stage': the trainer keeps no reference policy; set "
                "algorithm.use_kl_loss or use_kl_in_reward"
            )
        self.firsts = {s.first for s in stages[1:]}
        self.trainer = trainer
        self.snapshot_step = 0  # the step whose start took the current reference (0: the initial model)

    def before_step(self, step: int) -> None:
        if step in self.firsts:
            self.trainer.reference.load_state_dict(self.trainer.model.state_dict())
            self.snapshot_step = step

    def save(self, directory: Path) -> None:
        if self.snapshot_step:
            save_model(self.trainer.reference, str(directory / self.FILE))

    def restore(self, checkpoint: Path, step: int) -> None:
        """After the trainer loaded the checkpoint of ``step``: the reference it held then."""
        taken = max((f for f in self.firsts if f <= step), default=0)
        if not taken:
            return
        path = checkpoint / self.FILE
        if not path.is_file():
            raise ValueError(
                f"the checkpoint {checkpoint} has no {self.FILE}, but data.stage_reference 'previous_stage' needs "
                f"the reference taken at step {taken}; resume with data.stage_reference 'initial' or from a "
                "checkpoint of a run that had it"
            )
        load_model(self.trainer.reference, str(path), device=str(next(self.trainer.reference.parameters()).device))
        self.snapshot_step = taken


class StageEvaluator:
    """Evaluates the stages seen so far and keeps each one's best accuracy (see the module docstring);
    with ``reference``, also moves the KL reference at each stage's first step (``before_step``) and
    writes it with the checkpoints (``write_model``)."""

    def __init__(self, stages: Sequence[Stage], reference: StageReference | None = None) -> None:
        self.stages = list(stages)
        self.best: dict[str, float] = {}
        self.reference = reference

    def before_step(self, step: int) -> None:
        if self.reference is not None:
            self.reference.before_step(step)

    def write_model(self, save: Callable[[Path], None]) -> Callable[[Path], None]:
        """The checkpoint's model writer ``save`` plus the stage reference (when there is one)."""
        if self.reference is None:
            return save
        reference = self.reference

        def write(directory: Path) -> None:
            save(directory)
            reference.save(directory)

        return write

    def is_boundary(self, step: int) -> bool:
        """True at a stage's last step (an eval point: the accuracy matrix's row after that stage)."""
        return any(step == s.last for s in self.stages)

    def evaluate(self, producer: RolloutProducer, step: int, *, pass_k: int, seed: int) -> dict[str, float]:
        current = stage_of_step(self.stages, step)
        out: dict[str, float] = {}
        per_key: dict[str, list[float]] = {}
        accuracy: dict[str, float] = {}
        timing = 0.0
        for stage in self.stages[: current + 1]:
            m = evaluate(producer, stage.eval, pass_k=pass_k, seed=seed)
            timing += m.pop("timing_s/eval", 0.0)
            for key, value in m.items():
                name = key.removeprefix("eval/")
                out[f"eval/{stage.name}/{name}"] = value
                per_key.setdefault(key, []).append(value)
            if "eval/accuracy" in m:
                accuracy[stage.name] = m["eval/accuracy"]
        for key, values in per_key.items():
            out[key] = float(np.mean(values))
        earlier = [s.name for s in self.stages[:current]]
        out.update(forgetting(self.best, accuracy, earlier))
        for name, acc in accuracy.items():
            self.best[name] = max(self.best.get(name, acc), acc)
        if per_key:
            out["timing_s/eval"] = timing
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = {str(k): float(v) for k, v in (state.get("best") or {}).items()}
