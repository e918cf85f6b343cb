"""Generate, score and filter: everything that turns prompts into a trainable ``RolloutBatch``.

The producer owns the prompt sampler, the rollout backend and the reward manager. One call
to ``produce`` makes one step's batch: it samples ``prompts_per_step`` prompts (fewer with rollout
replay, ``replay.ratio``: the orchestrator adds the replayed groups, see ``fresh_groups``), generates
``n`` completions each, scores them, and with dynamic sampling (DAPO, arXiv:2503.14476,
section 3.2) drops groups whose rewards are all equal (they carry no GRPO gradient) and
samples again until the batch is full or ``max_num_gen_batches`` rounds are spent. Every scored
group, kept or filtered, is recorded in the prompt statistics of a :class:`PromptSelector`
(``data.selection``), whose ``selection/*`` metrics join the step's.

Two controls of issue 16 sit here too. ``rollout.n_schedule: frontier`` gives each prompt of a
round its own group size from its statistics (engine/data/allocation.py); the round is then
generated as one call with every prompt repeated its group size times (``n = 1``), and a group is
the rows with one ``Rollout.group`` id, whatever their number. ``replay.successes`` lets a stored
success join a group whose completions all failed, before the filter (engine/data/success_replay.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.batch import Rollout, RolloutBatch, collate, rollouts_from_groups
from engine.config import RunConfig
from engine.data import Prompt, PromptSampler, PromptSelector
from engine.data.allocation import Allocation, allocate, expand, merge_metrics
from engine.data.prompt_stats import success_values
from engine.rewards import RewardInput, RewardManager, RewardResult
from engine.rollout import PromptCompletions, RolloutBackend, SamplingParams
from engine.system_metrics import PHASE

if TYPE_CHECKING:
    from engine.data.success_replay import SuccessBank

CORRECTNESS = re.compile(r"(task|math|exact_match)(_\d+)?")
"""Reward components that mean "the answer is right" (a repeated name gets ``_2``, ...):
the first one configured is the accuracy."""


def correctness_component(components: dict[str, list[float]]) -> str | None:
    """Name of the accuracy component among a result's components (None if there is none)."""
    return next((name for name in components if CORRECTNESS.fullmatch(name)), None)


def groups_of(rows: Sequence[Rollout]) -> list[list[Rollout]]:
    """``rows`` cut into their groups (one ``Rollout.group`` id each), in order of first appearance:
    a group may hold any number of rows (``rollout.n_schedule``, an injected success)."""
    groups: dict[str, list[Rollout]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    return list(groups.values())


@dataclass
class ProducedBatch:
    batch: RolloutBatch | None  # None when every group was filtered out
    metrics: dict[str, float] = field(default_factory=dict)
    generated: list[Rollout] = field(default_factory=list)  # all rollouts, kept or not
    accuracy_component: str | None = None
    injected: list[Rollout] = field(default_factory=list)  # stored successes that joined a group

    @property
    def shown(self) -> list[Rollout]:
        """The generated rows with each injected success right after its group's rows (the samples
        event shows them, ``extra.replayed`` marking the injected one)."""
        if not self.injected:
            return self.generated
        joined = {}
        for row in self.injected:
            joined.setdefault(row.group, []).append(row)
        return [r for g in groups_of(self.generated) for r in g + joined.get(g[0].group, [])]


def replayed_groups(cfg: RunConfig, step: int) -> int:
    """Groups step ``step`` takes from the rollout replay buffer (``replay.ratio``): none at a run's
    first step, whose buffer is still empty. The producer generates only the rest."""
    return round(cfg.replay.ratio * cfg.trainer.prompts_per_step) if step > 1 else 0


def fresh_groups(cfg: RunConfig, step: int) -> int:
    """Groups step ``step`` generates: ``prompts_per_step`` less those it replays."""
    return cfg.trainer.prompts_per_step - replayed_groups(cfg, step)


MIN_KEEP_RATE = 1 / 8
"""The keep rate a deficit-sized round assumes at least: a step whose groups were nearly all filtered
so far samples at most a whole batch again (``max_num_gen_batches`` rounds bound the rest)."""


def round_prompts(want: int, kept: int, generated: int, round_: int, size: str) -> int:
    """Prompts to sample in round ``round_`` (0 first) of a step that needs ``want`` groups and has
    kept ``kept`` of the ``generated`` groups scored so far.

    ``full`` (DAPO, arXiv:2503.14476, section 3.2, as verl's ``gen_batch_size``): ``want`` every
    round, so the round that completes a nearly full batch throws most of its groups away.
    ``deficit``: the missing ``want - kept`` groups divided by this step's keep rate
    ``kept / generated`` (at least ``MIN_KEEP_RATE``), the expected number of prompts that refill
    the batch: a zero-variance group avoided (``data.selection``) saves its tokens, not only whole
    rounds. Never more than ``want``."""
    if round_ == 0 or size == "full":
        return want
    missing = want - kept
    rate = max(MIN_KEEP_RATE, kept / generated) if generated else 1.0
    return max(1, min(want, math.ceil(missing / rate)))


def seed_for(base: int, step: int, round_: int = 0) -> int:
    """A per-step sampling seed, so a resumed run samples exactly what a straight run would."""
    return (base * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


class RolloutProducer:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        sampler: PromptSampler | PromptSelector,
        backend: RolloutBackend,
        rewards: RewardManager,
        pad_id: int,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.backend = backend
        self.rewards = rewards
        self.pad_id = pad_id
        self.decode = decode  # token ids -> text, for completions assembled from parts (partial rollouts)
        # Imported here: the bank's checkpoint helpers are the pipeline's (engine/pipeline/partial.py).
        from engine.data.success_replay import SuccessBank

        self.successes: SuccessBank | None = SuccessBank.from_config(cfg)
        self._allocations: list[Allocation] = []

    def observe(self, rows: list[Rollout], accuracy_component: str | None, step: int) -> None:
        """Record each scored group of ``rows`` (whole groups, in order) in the prompt statistics:
        success = the accuracy component when the reward has one, else the reward, in [0, 1]."""
        if not isinstance(self.sampler, PromptSelector):
            return
        for group in groups_of([r for r in rows if not r.replayed]):
            scores = (
                [r.components[accuracy_component] for r in group]
                if accuracy_component
                else [r.reward for r in group]
            )
            self.sampler.observe(group[0].prompt.uid, success_values(scores), step)

    def selection_metrics(self) -> dict[str, float]:
        """The step's ``selection/*`` metrics (none from a plain sampler)."""
        return self.sampler.metrics() if isinstance(self.sampler, PromptSelector) else {}

    def step_metrics(self) -> dict[str, float]:
        """The step's ``selection/*``, ``rollout/n_*`` (frontier schedule) and ``replay/success_*``
        metrics since the last call; resets them."""
        out = self.selection_metrics()
        out.update(merge_metrics(self._allocations))
        self._allocations = []
        if self.successes is not None:
            out.update(self.successes.metrics())
        return out

    def group_sizes(self, prompts: Sequence[Prompt]) -> list[int]:
        """Completions for each of a round's ``prompts``: ``rollout.n`` each, or the frontier allocation
        of the same total from the prompts' own statistics (``rollout.n_schedule``; allocation.py)."""
        r = self.cfg.rollout
        if r.n_schedule == "fixed" or not isinstance(self.sampler, PromptSelector):
            return [r.n] * len(prompts)
        records = [self.sampler.stats.get(p.uid) for p in prompts]
        allocation = allocate(
            [rec.mean if rec is not None else 0.5 for rec in records],
            [rec is not None for rec in records],
            n=r.n,
            n_min=r.n_min,
            n_max=r.n_max,
        )
        self._allocations.append(allocation)
        return allocation.sizes

    def admit(self, tally: StepTally, rows: list[Rollout], result: RewardResult, step: int) -> None:
        """Scored ``rows`` into the step's ``tally``: a stored success joins each group that has none
        (``replay.successes``), the filter keeps or drops the groups, the statistics record them."""
        injected: list[Rollout] = []
        if self.successes is not None:
            accuracy = correctness_component(result.components)
            injected = self.successes.process(groups_of(rows), accuracy, self.backend.policy_version)
        tally.add_scored(rows, result, injected)
        self.observe(rows, tally.accuracy_component, step)

    def sampling_params(
        self, *, n: int, temperature: float | None = None, seed: int | None = None, token_view: bool = True
    ) -> SamplingParams:
        """``token_view``: the completions may be shown token by token (training rollouts, when
        ``logging.token_samples_per_step`` > 0), so their entropies are worth computing."""
        r, log = self.cfg.rollout, self.cfg.logging
        shown = token_view and log.token_samples_per_step > 0
        return SamplingParams(
            n=n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(r.stop),
            seed=seed,
            entropies=shown,
            # vLLM's entropies are only worth their top-k log-probs when some samples will show them.
            entropy_top_k=log.token_entropy_top_k if shown else 0,
        )

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, sizes: Sequence[int] | None = None
    ) -> list[PromptCompletions]:
        """``sizes[i]`` completions of prompt i (``params.n`` each without ``sizes``). Unequal sizes are
        one backend call with each prompt repeated its size times at n = 1: every backend seeds each
        sequence by its position, so the copies sample independently, and a call stays one batch."""
        if sizes is None or len(set(sizes)) <= 1:
            n = sizes[0] if sizes else params.n
            return self.backend.generate([p.token_ids for p in prompts], dataclasses.replace(params, n=n))
        owners = expand(len(prompts), sizes)
        outs = self.backend.generate([prompts[i].token_ids for i in owners], dataclasses.replace(params, n=1))
        groups = [PromptCompletions(list(p.token_ids)) for p in prompts]
        for i, out in zip(owners, outs, strict=True):
            groups[i].completions.extend(out.completions)
        return groups

    def generate_and_score(
        self, prompts: list[Prompt], params: SamplingParams, step: int, sizes: Sequence[int] | None = None
    ) -> tuple[list[Rollout], RewardResult, float, float]:
        """Rollouts for ``prompts`` (``sizes``: completions of each) with their rewards, and (gen
        seconds, reward seconds)."""
        t0 = time.perf_counter()
        with PHASE("generate"):
            groups = self.generate(prompts, params, sizes)
        t1 = time.perf_counter()
        with PHASE("score"):
            rows, result = self.score(prompts, groups, params.max_new_tokens, step)
        return rows, result, t1 - t0, time.perf_counter() - t1

    def score(
        self, prompts: list[Prompt], groups: list[PromptCompletions], max_new_tokens: int, step: int
    ) -> tuple[list[Rollout], RewardResult]:
        """Reward every completion of ``groups`` (one per prompt); the rollouts in group order."""
        inputs = [
            RewardInput(
                completion=c.text,
                answer=p.answer,
                prompt=p.raw,
                metadata=p.metadata,
                response_length=len(c.token_ids),
                max_response_length=max_new_tokens,
                finish_reason=c.finish_reason,
            )
            for p, g in zip(prompts, groups, strict=True)
            for c in g.completions
        ]
        result = self.rewards.score(inputs)
        return rollouts_from_groups(prompts, groups, result.total, result.components, step), result

    def produce(
        self, step: int, on_slice: Callable[[list[list[Rollout]]], None] | None = None, slices: int = 1
    ) -> ProducedBatch:
        """One step's batch. With ``on_slice``, each round is generated in ``slices`` parts and the
        groups each part adds to the batch are handed to ``on_slice`` as soon as they are scored (the
        periodic mode's overlap); a round stops early once the batch is full."""
        cfg = self.cfg
        want = fresh_groups(cfg, step)
        fg = cfg.algorithm.filter_groups
        tally = StepTally(cfg, want=want)
        if hasattr(self.sampler, "begin_step"):  # data.stages: the step's stage draws (engine/data/stages.py)
            self.sampler.begin_step(step)
        for round_ in range(fg.max_num_gen_batches if fg.enable else 1):
            tally.rounds += 1
            count = round_prompts(want, len(tally.kept), tally.total_groups, round_, fg.round_size)
            tally.prompts += count
            prompts = self.sampler.next_batch(count)
            sizes = self.group_sizes(prompts)
            seed = seed_for(cfg.trainer.seed, step, round_)
            size = max(1, math.ceil(len(prompts) / slices) if on_slice is not None else len(prompts))
            for part, start in enumerate(range(0, len(prompts), size)):
                params = self.sampling_params(n=cfg.rollout.n, seed=seed + part)
                rows, result, g_s, r_s = self.generate_and_score(
                    prompts[start : start + size], params, step, sizes[start : start + size]
                )
                tally.gen_s += g_s
                tally.reward_s += r_s
                tally.gen_tokens += sum(len(r.completion.token_ids) for r in rows)
                before = len(tally.kept)
                self.admit(tally, rows, result, step)
                if on_slice is not None and before < want:
                    on_slice(tally.kept[before:want])
                if len(tally.kept) >= want:
                    break
            if len(tally.kept) >= want:
                break
        return tally.produced(self.pad_id, self.step_metrics())


def collate_trainable(cfg: RunConfig, rows: list[Rollout], pad_id: int, policy_version: int) -> RolloutBatch:
    """``collate`` with ``algorithm.overlong_filter`` applied: truncated completions are masked out
    of the loss (DAPO, section 3.4)."""
    batch = collate(rows, pad_id, policy_version)
    if cfg.algorithm.overlong_filter:
        truncated = [i for i, r in enumerate(rows) if r.completion.finish_reason == "length"]
        batch.response_mask[truncated] = 0.0
    if any(r.replayed for r in rows):  # success replay's rows: the learner corrects them (off-policy)
        batch.extra["replayed"] = torch.tensor([r.replayed for r in rows])
    return batch


@dataclass
class StepTally:
    """One step's generation as it adds up: scored groups kept or filtered, timings, the batch.

    DAPO's dynamic sampling (arXiv:2503.14476, section 3.2) is here: a group whose rewards (or
    accuracies, ``filter_groups.metric``) are all equal carries no GRPO gradient and is left out
    when ``filter_groups.enable``; the share of such groups is reported either way.
    """

    cfg: RunConfig
    kept: list[list[Rollout]] = field(default_factory=list)
    generated: list[Rollout] = field(default_factory=list)  # every scored rollout, kept or not
    injected: list[Rollout] = field(default_factory=list)  # stored successes that joined a group
    results: list[RewardResult] = field(default_factory=list)
    accuracy_component: str | None = None
    gen_s: float = 0.0
    reward_s: float = 0.0
    gen_tokens: int = 0
    zero_std_groups: int = 0
    total_groups: int = 0
    rounds: int = 0
    prompts: int = 0  # sampled over the step's rounds (``filter/gen_prompts``)
    want: int = 0
    """Groups the batch takes (0: ``prompts_per_step``; fewer when rollout replay fills the rest)."""
    take_all: bool = False
    """Every kept group goes into the batch, not the first ``prompts_per_step``: partial rollouts keep
    no more than the step must train (more only for the groups ``async.stale_samples: wait`` forces)."""

    @property
    def batch_groups(self) -> list[list[Rollout]]:
        return self.kept if self.take_all else self.kept[: self.want or self.cfg.trainer.prompts_per_step]

    def add_scored(
        self, rows: list[Rollout], result: RewardResult, injected: Sequence[Rollout] = ()
    ) -> None:
        """Scored rollouts, whole groups in order, and the stored successes ``injected`` into some of them
        (each after its group's rows): keep the groups that pass the filter. ``frac_reward_zero_std``
        counts the generated groups; the filter judges a group with its injected success."""
        fg = self.cfg.algorithm.filter_groups
        self.results.append(result)
        self.generated.extend(rows)
        self.injected.extend(injected)
        self.accuracy_component = correctness_component(result.components)
        acc = self.accuracy_component

        def all_equal(group: list[Rollout]) -> bool:
            by_acc = fg.metric == "acc" and acc
            values = [r.components[acc] if by_acc else r.reward for r in group]
            return len(group) > 1 and float(np.std(values)) == 0.0

        for group in groups_of(list(rows) + list(injected)):
            self.total_groups += 1
            self.zero_std_groups += all_equal([r for r in group if not r.replayed])
            if not (fg.enable and all_equal(group)):
                self.kept.append(group)

    def metrics(self) -> dict[str, float]:
        out = {
            "timing_s/gen": self.gen_s,
            "timing_s/reward": self.reward_s,
            "frac_reward_zero_std": self.zero_std_groups / max(1, self.total_groups),
            "perf/gen_tokens_per_s": self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0,
            "rollout/gen_tokens": float(self.gen_tokens),
            "reward/errors": float(sum(r.errors for r in self.results)),
            "reward/timeouts": float(sum(r.timeouts for r in self.results)),
        }
        if self.cfg.algorithm.filter_groups.enable:
            out["filter/gen_rounds"] = float(self.rounds)
            if self.prompts:  # the partial mode's rounds top up its pool instead
                out["filter/gen_prompts"] = float(self.prompts)
            out["filter/kept_groups"] = float(len(self.batch_groups))
        return out

    def produced(self, pad_id: int, extra_metrics: dict[str, float] | None = None) -> ProducedBatch:
        """The step's batch: the kept groups it takes (``batch_groups``; None when none was kept).

        Its ``policy_version`` is that of its oldest sample. With ``algorithm.overlong_filter``,
        truncated completions are masked out of the loss (DAPO, section 3.4).
        """
        metrics = self.metrics() | (extra_metrics or {})
        rows = [r for g in self.batch_groups for r in g]
        if not rows:
            return ProducedBatch(None, metrics, self.generated, self.accuracy_component, self.injected)
        version = min((r.completion.policy_version for r in rows if not r.replayed), default=0)
        batch = collate_trainable(self.cfg, rows, pad_id, version)
        batch.extra["reward_messages"] = [m for r in self.results for m in r.error_messages]
        return ProducedBatch(batch, metrics, self.generated, self.accuracy_component, self.injected)
