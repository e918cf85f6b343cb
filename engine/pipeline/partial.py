"""Partial rollouts (APRIL: Zhou et al. 2025, "APRIL: Active Partial Rollouts in Reinforcement
Learning to Tame Long-tail Generation", arXiv:2509.18521).

A synchronous step waits for its longest completion. APRIL over-provisions requests, stops a
rollout round as soon as enough groups have finished, and carries the unfinished completions
into the next round, where they continue from where they stopped with the newer weights.

Here a round generates in chunks of ``async.partial_chunk_tokens`` tokens through the ordinary
backend protocol (any backend: the torch one and vLLM alike): every unfinished completion is
continued as a prompt of its own (prompt + the tokens so far, one sample, the chunk as the token
budget). After each chunk the finished groups are scored and filtered (DAPO's dynamic sampling
too) until the step has ``trainer.prompts_per_step`` groups; the rest stay in flight for the
next step. The pool in flight is topped up to ``prompts_per_step x (1 + async.overprovision)``
groups at the start of each step (and again, up to ``algorithm.filter_groups.max_num_gen_batches``
times, when filtering leaves the step short and nothing is left in flight).

Every token segment keeps the version of the weights that produced it
(:attr:`PartialCompletion.segments`); a completion's ``policy_version`` is its *oldest*
segment's, so the staleness the trainer checks (and drops beyond ``async.max_staleness``) is
that of its stalest token. Continuing re-reads the prefix with the new weights (the KV of the
old ones is not reused), as AReaL and APRIL do; the stored log-probs stay those the tokens were
sampled with: the behaviour policy the importance weights correct for.

In flight groups are not part of a checkpoint: a resumed run starts its pool afresh (those
prompts are not trained on).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import RunConfig
from engine.data import Prompt, PromptSampler
from engine.pipeline.batch import Rollout
from engine.pipeline.producer import ProducedBatch, RolloutProducer, StepTally, seed_for
from engine.rewards import RewardResult
from engine.rollout import Completion, PromptCompletions


@dataclass
class PartialCompletion:
    """A completion being generated across chunks (and rounds)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)  # (policy version, tokens), in order
    finish_reason: str | None = None  # None while unfinished

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        if not token_ids:
            return
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        if self.segments and self.segments[-1][0] == version:
            self.segments[-1] = (version, self.segments[-1][1] + len(token_ids))
        else:
            self.segments.append((version, len(token_ids)))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (and their log-probs and segments)."""
        del self.token_ids[length:], self.logprobs[length:]
        kept, segments = 0, []
        for version, n in self.segments:
            if kept < length:
                segments.append((version, min(n, length - kept)))
                kept += n
        self.segments = segments

    @property
    def oldest_version(self) -> int:
        return min(v for v, _ in self.segments) if self.segments else -1


@dataclass
class PartialGroup:
    """The ``n`` completions of one prompt, in flight until all are finished."""

    prompt: Prompt
    completions: list[PartialCompletion]
    started_step: int

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    @property
    def oldest_version(self) -> int:
        return min(c.oldest_version for c in self.completions)


class PartialRolloutProducer:
    """Produces a step's batch from a pool of groups in flight (see the module docstring)."""

    def __init__(self, producer: RolloutProducer) -> None:
        if producer.decode is None:
            raise ValueError("partial rollouts need the producer's decode (token ids -> text)")
        self.producer = producer
        self.cfg: RunConfig = producer.cfg
        self.decode: Callable[[list[int]], str] = producer.decode
        self.in_flight: list[PartialGroup] = []
        a = self.cfg.async_
        r = self.cfg.rollout
        self.chunk = a.partial_chunk_tokens or max(1, math.ceil(r.max_new_tokens / 4))
        self.pool_size = math.ceil(self.cfg.trainer.prompts_per_step * (1 + a.overprovision))

    @property
    def sampler(self) -> PromptSampler:
        return self.producer.sampler

    def _top_up(self, step: int) -> int:
        missing = max(0, self.pool_size - len(self.in_flight))
        for prompt in self.sampler.next_batch(missing) if missing else []:
            group = PartialGroup(prompt, [PartialCompletion() for _ in range(self.cfg.rollout.n)], step)
            self.in_flight.append(group)
        return missing

    def _generate_chunk(self, step: int, call: int) -> tuple[int, float]:
        """One chunk for every unfinished completion; returns (tokens kept, seconds)."""
        r = self.cfg.rollout
        todo = [(g, c) for g in self.in_flight for c in g.completions if c.finish_reason is None]
        prefixes = [list(g.prompt.token_ids) + c.token_ids for g, c in todo]
        params = self.producer.sampling_params(n=1, seed=seed_for(self.cfg.trainer.seed, step, 1000 + call))
        params = dataclasses.replace(params, max_new_tokens=self.chunk)
        backend = self.producer.backend
        t0 = time.perf_counter()
        outputs: list[PromptCompletions] = backend.generate(prefixes, params)
        seconds = time.perf_counter() - t0
        version = backend.policy_version
        kept = 0
        for (_, c), out in zip(todo, outputs, strict=True):
            new = out.completions[0]
            room = r.max_new_tokens - len(c.token_ids)
            ids, lps = new.token_ids[:room], new.logprobs[:room]
            c.add(ids, lps, version)
            kept += len(ids)
            if new.finish_reason == "stop" and len(new.token_ids) <= room:
                c.finish_reason = "stop"
            elif len(c.token_ids) >= r.max_new_tokens:
                c.finish_reason = "length"
            elif r.stop:
                self._stop_across_chunks(c)
        return kept, seconds

    def _stop_across_chunks(self, c: PartialCompletion) -> None:
        """A stop string split across two chunks: the backend saw neither half whole."""
        text = self.decode(c.token_ids)
        if not any(s in text for s in self.cfg.rollout.stop):
            return
        for end in range(1, len(c.token_ids) + 1):  # the shortest prefix that contains it
            if any(s in self.decode(c.token_ids[:end]) for s in self.cfg.rollout.stop):
                c.truncate(end)
                c.finish_reason = "stop"
                return

    def _take_finished(self, limit: int) -> list[PartialGroup]:
        """Up to ``limit`` finished groups, stalest first (their staleness only grows)."""
        finished = sorted((g for g in self.in_flight if g.finished), key=lambda g: g.oldest_version)[:limit]
        taken = {id(g) for g in finished}
        self.in_flight = [g for g in self.in_flight if id(g) not in taken]
        return finished

    def _rollouts(self, groups: list[PartialGroup], step: int) -> tuple[list[Rollout], RewardResult]:
        """Score finished groups; their rows in group order, with the reward result."""
        prompts = [g.prompt for g in groups]
        outs = [
            PromptCompletions(
                list(g.prompt.token_ids),
                [
                    Completion(
                        list(c.token_ids),
                        list(c.logprobs),
                        self.decode(c.token_ids),
                        c.finish_reason,  # type: ignore[arg-type]
                        c.oldest_version,
                        segments=list(c.segments),
                    )
                    for c in g.completions
                ],
            )
            for g in groups
        ]
        return self.producer.score(prompts, outs, self.cfg.rollout.max_new_tokens, step)

    def produce(self, step: int) -> ProducedBatch:
        cfg = self.cfg
        want = cfg.trainer.prompts_per_step
        fg = cfg.algorithm.filter_groups
        tally = StepTally(cfg, rounds=1)
        carried = len(self.in_flight)
        new_groups = self._top_up(step)
        calls = resumed = 0
        while len(tally.kept) < want:
            ready = self._take_finished(want - len(tally.kept))
            if ready:
                resumed += sum(g.started_step < step for g in ready)
                t0 = time.perf_counter()
                rows, result = self._rollouts(ready, step)
                tally.reward_s += time.perf_counter() - t0
                tally.add_scored(rows, result)
            elif any(not g.finished for g in self.in_flight):
                tokens, seconds = self._generate_chunk(step, calls)
                calls += 1
                tally.gen_tokens += tokens
                tally.gen_s += seconds
            elif tally.rounds < (fg.max_num_gen_batches if fg.enable else 1):
                tally.rounds += 1
                new_groups += self._top_up(step)
            else:
                break
        trained = [r for g in tally.kept[:want] for r in g]
        return tally.produced(
            self.producer.pad_id,
            {
                "partial/chunks": float(calls),
                "partial/new_groups": float(new_groups),
                "partial/resumed_groups": float(resumed),
                "partial/in_flight_groups": float(len(self.in_flight)),
                "partial/carried_in_groups": float(carried),
                "partial/multi_version_frac": (
                    sum(len({v for v, _ in r.completion.segments}) > 1 for r in trained) / max(1, len(trained))
                ),
            },
        )
