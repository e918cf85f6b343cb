"""The prompts and rewards of a run with ``data.stages`` (continual training; the schedule and its rules
are ``engine/config/stages.py``).

* :func:`load_stages` loads each stage's train and eval prompts with the stage's own data config. A
  prompt's uid gets the stage's name in front (``<stage>/<uid>``), so two stages over the same data
  keep apart in the prompt statistics, the replay buffers and the checkpoint.
* :class:`StagedSelector` is the run's prompt source (the :class:`PromptSelector` API): one
  selector per stage, each with its own epochs and prompt statistics (``data.selection`` works within
  a stage as in a run of one stage, and a stage's statistics survive the switch: its prompts replayed
  later are estimated from them). ``begin_step(step)`` (the producer calls it before drawing a step's
  batch) picks the stage; ``replay.previous_stages`` draws ``round(f x k)`` of a k-prompt batch from
  the earlier stages, spread evenly over them (the remainder rotating from batch to batch), each
  earlier stage's share drawn by that stage's own selector (general replay: RECAP arXiv:2510.21978,
  GeRe arXiv:2508.04676). The state is every stage's selector state and the number of replay draws:
  the stage itself follows from the step, so a resume mid-stage or across a boundary is exact.
* :class:`StagedRewards` scores each completion with the reward of the stage its prompt came from
  (``data.stages[i].reward_functions``, else ``reward.functions``), so a replayed prompt keeps its own stage's reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import RunConfig
from engine.config.model_data import DataConfig
from engine.config.stages import stage_at, stage_bounds
from engine.data.likelihood import AnswerScorer
from engine.data.prompt_stats import PromptRecord, PromptStats
from engine.data.prompts import Prompt, PromptSplits, load_prompts
from engine.data.selection import PromptSelector
from engine.rewards import RewardInput, RewardManager, RewardResult


@dataclass
class Stage:
    """One loaded stage: its name, its steps ``first..last``, its data config and prompts."""

    index: int
    name: str
    first: int
    last: int
    data: DataConfig
    train: list[Prompt]
    eval: list[Prompt]
    skipped_too_long: int = 0


def load_stages(cfg: RunConfig, tokenizer: Any) -> list[Stage]:
    """Every stage's prompts (its uids prefixed with the stage's name)."""
    out: list[Stage] = []
    for i, (sc, (first, last)) in enumerate(zip(cfg.data.stages, stage_bounds(cfg.data.stages), strict=True)):
        data = sc.data_config(cfg.data)
        splits = load_prompts(data, tokenizer, seed=cfg.trainer.seed)

        def own(p: Prompt, name: str = sc.name) -> Prompt:
            # A metadata dict of its own: StagedRewards tells the stages' prompts apart by it.
            return dataclasses.replace(p, uid=f"{name}/{p.uid}", metadata=dict(p.metadata))

        out.append(
            Stage(
                i, sc.name, first, last, data,
                [own(p) for p in splits.train], [own(p) for p in splits.eval], splits.skipped_too_long,
            )
        )
    return out


def combined_splits(stages: Sequence[Stage]) -> PromptSplits:
    """All stages' prompts as one split (what the replay buffer and the checkpoint look prompts up in)."""
    return PromptSplits(
        train=[p for s in stages for p in s.train],
        eval=[p for s in stages for p in s.eval],
        skipped_too_long=sum(s.skipped_too_long for s in stages),
    )


def previous_shares(m: int, earlier: int, rotation: int) -> list[int]:
    """``m`` replayed prompts over ``earlier`` stages: ``m // earlier`` each, and the ``m % earlier``
    left over to the stages ``rotation, rotation + 1, ...`` (mod ``earlier``), so over batches every
    earlier stage gets the same share."""
    base, extra = divmod(m, earlier)
    return [base + (1 if (j - rotation) % earlier < extra else 0) for j in range(earlier)]


class _StagedStats:
    """The prompt statistics of every stage, read by uid (what ``PromptSelector.stats`` offers readers:
    ``rollout.n_schedule`` looks prompts up in it)."""

    def __init__(self, selector: StagedSelector) -> None:
        self._selector = selector

    def _of(self, uid: object) -> PromptStats | None:
        index = self._selector._owner.get(uid) if isinstance(uid, str) else None
        return None if index is None else self._selector.selectors[index].stats

    def get(self, uid: str) -> PromptRecord | None:
        stats = self._of(uid)
        return None if stats is None else stats.get(uid)

    def __contains__(self, uid: object) -> bool:
        stats = self._of(uid)
        return stats is not None and uid in stats

    def __len__(self) -> int:
        return sum(len(s.stats) for s in self._selector.selectors)


class StagedSelector(PromptSelector):
    """The prompt source of a staged run (see the module docstring).

    A :class:`PromptSelector` to its users (the producer records statistics and reads metrics of
    any), built of one per stage: it overrides every method the pipeline calls and keeps no prompts
    of its own, so the base's constructor is not run."""

    def __init__(self, cfg: RunConfig, stages: Sequence[Stage]) -> None:
        self.stages = list(stages)
        self.fraction = cfg.replay.previous_stages
        self.selectors = [
            PromptSelector(
                s.train,
                selection=cfg.data.selection,
                options=cfg.data.selection_options,
                shuffle=s.data.shuffle,
                seed=cfg.trainer.seed + 7_919 * s.index,  # a stream of its own per stage
                group_size=cfg.rollout.n,
            )
            for s in self.stages
        ]
        self._owner = {p.uid: s.index for s in self.stages for p in s.train}
        self._configs = cfg.data.stages
        self.current = 0
        self.replay_draws = 0  # batches that drew from earlier stages: the rotation of the remainder
        self._drawn = 0
        self._replayed = 0
        self._mixed = False  # this step's earlier-stage prompts were drawn (its first batch)

    def __len__(self) -> int:
        return len(self._owner)

    @property
    def stats(self) -> _StagedStats:  # type: ignore[override]
        return _StagedStats(self)

    def attach_scorer(self, scorer: AnswerScorer) -> None:
        for selector in self.selectors:
            selector.attach_scorer(scorer)

    def begin_step(self, step: int) -> None:
        """The stage of step ``step`` draws the batches from now on."""
        self.current = stage_at(self._configs, step)
        self._mixed = False

    def replayed_count(self, k: int) -> int:
        """Prompts of a k-prompt batch drawn from earlier stages (none in the first stage; never all k)."""
        if self.current == 0 or self.fraction <= 0:
            return 0
        return max(0, min(k - 1, round(self.fraction * k)))

    def next_batch(self, k: int) -> list[Prompt]:
        """``k`` prompts: with ``replay.previous_stages``, the step's first batch mixes in earlier
        stages' prompts; the batches dynamic sampling draws again in the same step come from the
        current stage only. (Mixing into every round let the earlier stages' groups, which pass
        the filter more often than a new stage's, fill the whole trained batch.)"""
        m = 0 if self._mixed else self.replayed_count(k)
        self._mixed = True
        batch = self.selectors[self.current].next_batch(k - m)
        if m:
            shares = previous_shares(m, self.current, self.replay_draws % self.current)
            self.replay_draws += 1
            for j, share in enumerate(shares):
                if share:
                    batch.extend(self.selectors[j].next_batch(share))
        self._drawn += k
        self._replayed += m
        return batch

    def observe(self, uid: str, values: Sequence[float], step: int) -> None:
        if uid not in self._owner:
            raise KeyError(f"prompt {uid!r} is not one of this run's stages' prompts")
        self.selectors[self._owner[uid]].observe(uid, values, step)

    def metrics(self) -> dict[str, float]:
        """The current stage's ``selection/*`` metrics (the others' tallies reset), ``data/stage`` (the
        index of the stage that drew the step's batch) and ``replay/previous_stages_fraction``."""
        out: dict[str, float] = {}
        for i, selector in enumerate(self.selectors):
            m = selector.metrics()
            if i == self.current:
                out.update(m)
        out["data/stage"] = float(self.current)
        if self.fraction > 0:
            out["replay/previous_stages_fraction"] = self._replayed / self._drawn if self._drawn else 0.0
        self._drawn = self._replayed = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "stages": {s.name: sel.state_dict() for s, sel in zip(self.stages, self.selectors, strict=True)},
            "replay_draws": self.replay_draws,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("stages")
        names = [s.name for s in self.stages]
        if not isinstance(saved, Mapping) or list(saved) != names:
            have = list(saved) if isinstance(saved, Mapping) else "no stages"
            raise ValueError(
                f"the checkpoint's data position is for stages {have}, this run has data.stages {names}; "
                "resume with the same data.stages"
            )
        for name, selector in zip(names, self.selectors, strict=True):
            selector.load_state_dict(saved[name])
        self.replay_draws = int(state.get("replay_draws", 0))


class StagedRewards:
    """Scores each completion with its stage's reward manager (see the module docstring).

    A prompt's stage is known by its metadata dict (each stage's prompts have their own,
    :func:`load_stages`), which the producer hands to every ``RewardInput`` unchanged. When one
    call mixes stages whose rewards differ (a batch with prompts replayed from earlier stages), the
    result has every manager's components, 0.0 where an item's own reward has no such component.
    """

    def __init__(self, cfg: RunConfig, stages: Sequence[Stage]) -> None:
        self.default = RewardManager.from_config(cfg.reward)
        self.managers: list[RewardManager] = []
        for sc in cfg.data.stages:
            own = cfg.reward.model_copy(update={"functions": sc.reward_functions}) if sc.reward_functions else None
            self.managers.append(RewardManager.from_config(own) if own is not None else self.default)
        self._stage_of = {id(p.metadata): s.index for s in stages for p in (*s.train, *s.eval)}

    def _manager(self, item: RewardInput) -> int:
        return self._stage_of.get(id(item.metadata), -1)

    def score(self, items: Sequence[RewardInput]) -> RewardResult:
        by_manager: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            stage = self._manager(item)
            manager = self.managers[stage] if stage >= 0 else self.default
            by_manager.setdefault(id(manager), []).append(i)
        managers = {id(m): m for m in (self.default, *self.managers)}
        if len(by_manager) <= 1:
            key = next(iter(by_manager), id(self.default))
            return managers[key].score(items)
        n = len(items)
        total = [0.0] * n
        components: dict[str, list[float]] = {}
        merged = RewardResult(total, components)
        for key, indices in by_manager.items():
            part = managers[key].score([items[i] for i in indices])
            for j, i in enumerate(indices):
                total[i] = part.total[j]
            for name, values in part.components.items():
                column = components.setdefault(name, [0.0] * n)
                for j, i in enumerate(indices):
                    column[i] = values[j]
            merged.errors += part.errors
            merged.timeouts += part.timeouts
            merged.error_messages.extend(m for m in part.error_messages if m not in merged.error_messages)
        return merged

    def close(self) -> None:
        for manager in {id(m): m for m in (self.default, *self.managers)}.values():
            manager.close()

    def __enter__(self) -> StagedRewards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
