"""Partial rollouts (APRIL): no completion is lost, and every token segment keeps its version.

The producer runs for real: the arithmetic starter policy in the torch rollout backend, real
reward workers, generating one token per chunk with 4x over-provisioning, so each step stops
while many groups are still unfinished and continues them in the next step after the backend
took a new policy version.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import build_config
from engine.data import PromptSampler, load_prompts
from engine.models import load_model, load_tokenizer, resolve_model_path
from engine.pipeline.partial import PartialRolloutProducer
from engine.pipeline.producer import RolloutProducer
from engine.rewards import RewardManager
from engine.rollout import make_rollout_backend
from tests.engine.test_run import metrics_by_step, read_events, small_config

WANT, N, STEPS = 4, 4, 6


@pytest.fixture(scope="module")
def partial_run() -> list[dict]:
    cfg = build_config(
        {
            "preset": "grpo",
            "model": {"path": "starter"},
            "data": {"source": "builtin", "task": "arithmetic"},
            "rollout": {"n": N},
            "trainer": {"prompts_per_step": WANT},
            "async": {"max_staleness": 2, "partial_rollouts": True, "overprovision": 3.0, "partial_chunk_tokens": 1},
        }
    )
    path = resolve_model_path(cfg.model, cfg.data)
    model, tokenizer = load_model(path), load_tokenizer(path)
    splits = load_prompts(cfg.data, tokenizer, seed=0)
    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=256)
    steps = []
    with RewardManager(cfg.reward.functions, timeout_s=5, workers=1) as rewards:
        producer = RolloutProducer(
            cfg,
            sampler=PromptSampler(splits.train, shuffle=True, seed=0),
            backend=backend,
            rewards=rewards,
            pad_id=tokenizer.pad_token_id,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        partial = PartialRolloutProducer(producer)
        for step in range(1, STEPS + 1):
            before = {g.prompt.uid for g in partial.in_flight}
            produced = partial.produce(step)
            steps.append(
                {
                    "version": backend.policy_version,
                    "before": before,
                    "after": {g.prompt.uid for g in partial.in_flight},
                    "produced": produced,
                }
            )
            # The trainer's update: the backend takes the next policy version.
            backend.update_weights(model.state_dict(), backend.policy_version + 1)
    backend.close()
    return steps


def test_no_completion_is_lost(partial_run: list[dict]) -> None:
    for s in partial_run:
        produced, m = s["produced"], s["produced"].metrics
        scored = {r.prompt.uid for r in produced.generated}
        assert s["before"] <= scored | s["after"], "a group in flight vanished"
        groups_scored = len(produced.generated) // N
        assert m["partial/carried_in_groups"] + m["partial/new_groups"] == groups_scored + m["partial/in_flight_groups"]
        # No filter (GRPO): every scored group is trained, and the step is full.
        assert produced.batch is not None and len(produced.batch) == WANT * N
    assert any(s["produced"].metrics["partial/resumed_groups"] > 0 for s in partial_run)


def test_every_segment_keeps_the_version_that_generated_it(partial_run: list[dict]) -> None:
    multi = 0
    for s in partial_run:
        for row in s["produced"].batch.rows:
            c = row.completion
            versions = [v for v, _ in c.segments]
            assert sum(n for _, n in c.segments) == len(c.token_ids) == len(c.logprobs)
            assert versions == sorted(set(versions)), c.segments  # in order, one stretch per version
            assert c.policy_version == versions[0] and versions[-1] <= s["version"]
            assert c.finish_reason in ("stop", "length")
            multi += len(versions) > 1
    assert multi > 0, "no completion was continued by a newer version"


def test_a_partial_run_keeps_its_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.run import EXIT_SUCCEEDED, execute

    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=6)
    raw["async"] = {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 2}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    for step in range(1, 7):
        m = metrics[step]
        assert m["async/staleness_max"] <= 2 and m["async/dropped_stale"] >= 0
        assert m["partial/chunks"] >= 3  # 6 new tokens in chunks of 2


def test_truncating_a_completion_keeps_its_segments_in_step() -> None:
    """A stop string found across two chunks cuts the completion inside its second segment."""
    from engine.pipeline.partial import PartialCompletion

    c = PartialCompletion()
    c.add([1, 2], [-0.1, -0.2], version=0)
    c.add([3, 4, 5], [-0.3, -0.4, -0.5], version=1)
    c.add([6], [-0.6], version=1)
    assert c.segments == [(0, 2), (1, 4)]
    c.truncate(3)
    assert (c.token_ids, c.logprobs, c.segments) == ([1, 2, 3], [-0.1, -0.2, -0.3], [(0, 2), (1, 1)])
    c.truncate(2)
    assert c.segments == [(0, 2)] and c.oldest_version == 0
