"""Generate, score and filter: everything that turns prompts into a trainable ``RolloutBatch``.

The producer owns the prompt sampler, the rollout backend and the reward manager. One call
to ``produce`` makes one step's batch: it samples ``prompts_per_step`` prompts, generates
``n`` completions each, scores them, and with dynamic sampling (DAPO, arXiv:2503.14476,
section 3.2) drops groups whose rewards are all equal (they carry no GRPO gradient) and
samples again until the batch is full or ``max_num_gen_batches`` rounds are spent.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from engine.config import RunConfig
from engine.data import Prompt, PromptSampler
from engine.pipeline.batch import Rollout, RolloutBatch, collate, rollouts_from_groups
from engine.rewards import RewardInput, RewardManager, RewardResult
from engine.rollout import PromptCompletions, RolloutBackend, SamplingParams

CORRECTNESS = re.compile(r"(task|math|exact_match)(_\d+)?")
"""Reward components that mean "the answer is right" (a repeated name gets ``_2``, ...):
the first one configured is the accuracy."""


def correctness_component(components: dict[str, list[float]]) -> str | None:
    """Name of the accuracy component among a result's components (None if there is none)."""
    return next((name for name in components if CORRECTNESS.fullmatch(name)), None)


@dataclass
class ProducedBatch:
    batch: RolloutBatch | None  # None when every group was filtered out
    metrics: dict[str, float] = field(default_factory=dict)
    generated: list[Rollout] = field(default_factory=list)  # all rollouts, kept or not
    accuracy_component: str | None = None


def seed_for(base: int, step: int, round_: int = 0) -> int:
    """A per-step sampling seed, so a resumed run samples exactly what a straight run would."""
    return (base * 1_000_003 + step * 1_009 + round_) % (2**31 - 1)


class RolloutProducer:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        sampler: PromptSampler,
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

    def sampling_params(self, *, n: int, temperature: float | None = None, seed: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=n,
            temperature=r.temperature if temperature is None else temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop=tuple(r.stop),
            seed=seed,
        )

    def generate_and_score(
        self, prompts: list[Prompt], params: SamplingParams, step: int
    ) -> tuple[list[Rollout], RewardResult, float, float]:
        """Rollouts for ``prompts`` with their rewards, and (gen seconds, reward seconds)."""
        t0 = time.perf_counter()
        groups = self.backend.generate([p.token_ids for p in prompts], params)
        t1 = time.perf_counter()
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

    def produce(self, step: int) -> ProducedBatch:
        cfg = self.cfg
        want = cfg.trainer.prompts_per_step
        n = cfg.rollout.n
        fg = cfg.algorithm.filter_groups
        rounds = fg.max_num_gen_batches if fg.enable else 1
        kept: list[list[Rollout]] = []
        generated: list[Rollout] = []
        results: list[RewardResult] = []
        acc_name: str | None = None
        gen_s = reward_s = 0.0
        gen_tokens = 0
        zero_std_groups = total_groups = 0
        rounds_used = 0
        for round_ in range(rounds):
            rounds_used += 1
            prompts = self.sampler.next_batch(want)
            params = self.sampling_params(n=n, seed=seed_for(cfg.trainer.seed, step, round_))
            rows, result, g_s, r_s = self.generate_and_score(prompts, params, step)
            gen_s += g_s
            reward_s += r_s
            results.append(result)
            generated.extend(rows)
            gen_tokens += sum(len(r.completion.token_ids) for r in rows)
            acc_name = correctness_component(result.components)
            for gi in range(len(prompts)):
                group = rows[gi * n : (gi + 1) * n]
                if fg.metric == "acc" and acc_name is not None:
                    values = [r.components[acc_name] for r in group]
                else:
                    values = [r.reward for r in group]
                total_groups += 1
                all_equal = len(group) > 1 and float(np.std(values)) == 0.0
                zero_std_groups += all_equal
                if not (fg.enable and all_equal):
                    kept.append(group)
            if len(kept) >= want:
                break
        kept = kept[:want]
        metrics = {
            "timing_s/gen": gen_s,
            "timing_s/reward": reward_s,
            "frac_reward_zero_std": zero_std_groups / max(1, total_groups),
            "perf/gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/gen_tokens": float(gen_tokens),
            "reward/errors": float(sum(r.errors for r in results)),
            "reward/timeouts": float(sum(r.timeouts for r in results)),
        }
        if fg.enable:
            metrics["filter/gen_rounds"] = float(rounds_used)
            metrics["filter/kept_groups"] = float(len(kept))
        rows = [r for g in kept for r in g]
        if not rows:
            return ProducedBatch(None, metrics, generated, acc_name)
        batch = collate(rows, self.pad_id, self.backend.policy_version)
        if cfg.algorithm.overlong_filter:
            truncated = [i for i, r in enumerate(rows) if r.completion.finish_reason == "length"]
            batch.response_mask[truncated] = 0.0
        batch.extra["reward_messages"] = [m for r in results for m in r.error_messages]
        return ProducedBatch(batch, metrics, generated, acc_name)
