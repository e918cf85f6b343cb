"""Partial rollouts (APRIL): no completion is lost, every token segment keeps its version, no
trained sample is more than k versions old (``async.stale_samples`` wait or drop), and the pool
in flight survives a checkpoint.

The producer runs for real: the arithmetic starter policy in the torch rollout backend, real
reward workers, generating one token per chunk with 4x over-provisioning, so each step stops
while many groups are still unfinished and continues them in the next step after the backend
took a new policy version. The staleness property runs the producer in its thread against a
trainer through the asynchronous loop's gate, with random completion lengths and durations.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import build_config
from engine.data import Prompt, PromptSampler, load_prompts
from engine.models import load_model, load_tokenizer, resolve_model_path
from engine.pipeline.async_loop import GateClosed, StalenessGate, drop_stale
from engine.pipeline.partial import PartialRolloutProducer, groups_from_state, pool_state
from engine.pipeline.producer import RolloutProducer
from engine.rewards import RewardManager, RewardResult
from engine.rollout import Completion, PromptCompletions, make_rollout_backend
from tests.engine.test_run import cancel_then_resume, metrics_by_step, read_events, small_config

WANT, N, STEPS, K = 4, 4, 6, 2


def starter_config(stale_samples: str) -> Any:
    return build_config(
        {
            "preset": "grpo",
            "model": {"path": "starter"},
            "data": {"source": "builtin", "task": "arithmetic"},
            "rollout": {"n": N},
            "trainer": {"prompts_per_step": WANT},
            "async": {
                "max_staleness": K,
                "partial_rollouts": True,
                "overprovision": 3.0,
                "partial_chunk_tokens": 1,
                "stale_samples": stale_samples,
            },
        }
    )


@pytest.fixture(scope="module")
def starter() -> tuple[Any, Any, Any]:
    """The starter policy, its tokenizer and the arithmetic prompts (loaded once)."""
    cfg = starter_config("wait")
    path = resolve_model_path(cfg.model, cfg.data)
    model, tokenizer = load_model(path), load_tokenizer(path)
    return model, tokenizer, load_prompts(cfg.data, tokenizer, seed=0)


def starter_producer(
    cfg: Any, starter: tuple[Any, Any, Any], backend: Any, rewards: RewardManager
) -> RolloutProducer:
    _, tokenizer, splits = starter
    return RolloutProducer(
        cfg,
        sampler=PromptSampler(splits.train, shuffle=True, seed=0),
        backend=backend,
        rewards=rewards,
        pad_id=tokenizer.pad_token_id,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


@pytest.fixture(scope="module", params=["wait", "drop"])
def partial_run(request: pytest.FixtureRequest, starter: tuple[Any, Any, Any]) -> list[dict]:
    """STEPS steps of the synchronous schedule: step s is trained by the version its round was
    generated with (``version``), and the backend takes the next version after each step."""
    cfg = starter_config(request.param)
    model, tokenizer, _ = starter
    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=256)
    steps = []
    with RewardManager(cfg.reward.functions, timeout_s=5, workers=1) as rewards:
        partial = PartialRolloutProducer(starter_producer(cfg, starter, backend, rewards))
        for step in range(1, STEPS + 1):
            before = {g.prompt.uid for g in partial.in_flight}
            produced = partial.produce(step)
            steps.append(
                {
                    "version": backend.policy_version,
                    "before": before,
                    "after": {g.prompt.uid for g in partial.in_flight},
                    "produced": produced,
                    "stale_samples": request.param,
                }
            )
            # The trainer's update: the backend takes the next policy version.
            backend.update_weights(model.state_dict(), backend.policy_version + 1)
    backend.close()
    return steps


@pytest.mark.slow
@pytest.mark.starter("arithmetic")
def test_no_completion_is_lost(partial_run: list[dict]) -> None:
    for s in partial_run:
        produced, m = s["produced"], s["produced"].metrics
        scored = {r.prompt.uid for r in produced.generated}
        assert s["before"] <= scored | s["after"], "a group in flight vanished"
        groups_scored = len(produced.generated) // N
        assert (
            m["partial/carried_in_groups"] + m["partial/new_groups"]
            == groups_scored + m["partial/in_flight_groups"]
        )
        # No filter (GRPO): every scored group is trained, and the step is full; under "wait" it may
        # also hold the groups it had to finish, never more than were carried in.
        assert produced.batch is not None and len(produced.batch) == groups_scored * N
        if s["stale_samples"] == "drop":
            assert groups_scored == WANT and m["partial/forced_groups"] == 0
        else:
            assert WANT <= groups_scored <= max(WANT, m["partial/carried_in_groups"])
            assert m["partial/forced_groups"] <= groups_scored
    assert any(s["produced"].metrics["partial/resumed_groups"] > 0 for s in partial_run)


@pytest.mark.slow
@pytest.mark.starter("arithmetic")
def test_wait_trains_nothing_stale_and_drop_would_drop(partial_run: list[dict]) -> None:
    """The trainer of step s holds the version step s's round generated with: under "wait" no row
    of any batch is more than K versions behind it (some groups had to be finished for that);
    this long-tailed run under "drop" carries groups past the bound, for the trainer to drop."""
    lags = [s["version"] - r.completion.policy_version for s in partial_run for r in s["produced"].batch.rows]
    forced = sum(s["produced"].metrics["partial/forced_groups"] for s in partial_run)
    if partial_run[0]["stale_samples"] == "wait":
        assert max(lags) <= K and forced > 0
    else:
        assert max(lags) > K and forced == 0


@pytest.mark.slow
@pytest.mark.starter("arithmetic")
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


@pytest.mark.parametrize("stale_samples", ["wait", "drop"])
def test_a_partial_run_keeps_its_bound(stale_samples: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A whole run with long tails: completions stop at an "e" (about one token in six of the tiny
    model's vocabulary) or after 16 tokens, one token per chunk, and 12 groups in flight beside the
    4 a step trains, so some groups are carried past the bound. Under "wait" they are finished in
    time (forced) and nothing is dropped; under "drop" nothing is forced, and the trainer leaves
    out whole stale groups, counted, training nothing in a step whose every group was stale. Either
    way no trained sample is more than K versions old."""
    from engine.contracts import EXIT_SUCCEEDED
    from engine.run import execute

    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=6)
    assert raw["rollout"]["n"] == N and raw["trainer"]["prompts_per_step"] == WANT
    raw["rollout"].update({"max_new_tokens": 16, "stop": ["e"]})
    raw["async"] = {
        "max_staleness": K,
        "partial_rollouts": True,
        "partial_chunk_tokens": 1,
        "overprovision": 3.0,
        "stale_samples": stale_samples,
    }
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    dropped = forced = 0
    for step in range(1, 7):
        m = metrics[step]
        scored = N * (m["partial/carried_in_groups"] + m["partial/new_groups"] - m["partial/in_flight_groups"])
        trained = scored - m["async/dropped_stale"]
        assert m["async/dropped_stale"] % N == 0 and trained >= 0, (step, m)  # whole groups, of this step's
        if trained:
            assert "actor/grad_norm" in m and "async/staleness_max" in m, (step, "no update", m)
            assert m["async/staleness_max"] <= K, (step, m)
        else:  # every group was stale: no update, no lag to report
            assert "async/staleness_max" not in m and "actor/grad_norm" not in m, (step, m)
        dropped += m["async/dropped_stale"]
        forced += m["partial/forced_groups"]
    if stale_samples == "wait":
        assert dropped == 0 and forced > 0
    else:
        assert forced == 0 and dropped > 0


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


# ----------------------------------------------------------------------------- the bound, under both settings

EOS = 2


class ScriptedBackend:
    """A rollout backend of random lengths: each token ends its completion with probability
    ``p_stop``; each call sleeps up to ``max_sleep_s``. ``policy_version`` is set by the driver
    (the weights it would have loaded)."""

    def __init__(self, rng: random.Random, p_stop: float, max_sleep_s: float) -> None:
        self.rng, self.p_stop, self.max_sleep_s = rng, p_stop, max_sleep_s
        self.policy_version = 0

    def generate(self, prompts: list[list[int]], params: Any) -> list[PromptCompletions]:
        time.sleep(self.rng.random() * self.max_sleep_s)
        out = []
        for prompt in prompts:
            ids: list[int] = []
            finish = "length"
            while len(ids) < params.max_new_tokens:
                if self.rng.random() < self.p_stop:
                    ids.append(EOS)
                    finish = "stop"
                    break
                ids.append(self.rng.randrange(3, 60))
            lps = [-self.rng.random() for _ in ids]
            out.append(
                PromptCompletions(list(prompt), [Completion(ids, lps, "", finish, self.policy_version)])
            )
        return out

    def update_weights(self, state_dict: Any, version: int) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass


class CoinRewards:
    """Rewards of 0 or 1 at random: some groups all equal (filtered under dynamic sampling)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def score(self, inputs: list[Any]) -> RewardResult:
        values = [float(self.rng.random() < 0.5) for _ in inputs]
        return RewardResult(total=values, components={"task": list(values)})


def simulate(
    *,
    k: int,
    stale_samples: str,
    seed: int,
    steps: int,
    p_stop: float,
    chunk: int,
    overprovision: float,
    filter_groups: bool,
) -> dict[str, Any]:
    """The asynchronous loop's producer thread and trainer, as ``AsyncOrchestrator`` runs them for
    partial rollouts: the gate (lead k - 1, its version bound given to the producer), the newest
    weights taken before each round, and under "drop" the trainer's ``drop_stale``. The trainer
    updates (one version) only when its batch is not empty, so versions fall behind steps when
    dynamic sampling filters a whole step out. Asserts the bound on every batch."""
    rng = random.Random(seed)
    cfg = build_config(
        {
            "rollout": {"n": 2, "max_new_tokens": 10},
            "trainer": {"prompts_per_step": 3, "seed": seed},
            "algorithm": {"filter_groups": {"enable": filter_groups, "max_num_gen_batches": 2}},
            "async": {
                "max_staleness": k,
                "partial_rollouts": True,
                "overprovision": overprovision,
                "partial_chunk_tokens": chunk,
                "stale_samples": stale_samples,
            },
        }
    )
    prompts = [Prompt(uid=f"p{i}", text=f"p{i}", raw=f"p{i}", token_ids=[1, 3 + i]) for i in range(500)]
    backend = ScriptedBackend(random.Random(rng.random()), p_stop, max_sleep_s=0.002)
    producer = RolloutProducer(
        cfg,
        sampler=PromptSampler(prompts, shuffle=False),
        backend=backend,  # type: ignore[arg-type]
        rewards=CoinRewards(random.Random(rng.random())),  # type: ignore[arg-type]
        pad_id=0,
        decode=lambda ids: " ".join(map(str, ids)),
    )
    gate = StalenessGate(k - 1, trained_step=0, trained_version=0)
    partial = PartialRolloutProducer(producer, version_bound=gate.version_bound)
    trainer = {"version": 0}
    handed: queue.Queue = queue.Queue()

    def produce() -> None:
        try:
            for step in range(1, steps + 1):
                gate.wait(step)
                backend.update_weights({}, trainer["version"])  # the newest published weights
                handed.put((step, partial.produce(step)))
        except GateClosed:
            return
        except BaseException as exc:
            handed.put(exc)

    thread = threading.Thread(target=produce)
    thread.start()
    out = {"lags": [], "dropped": 0, "forced": 0, "scored_groups": 0, "new_groups": 0, "oversized": 0}
    try:
        for step in range(1, steps + 1):
            item = handed.get(timeout=60)
            if isinstance(item, BaseException):
                raise item
            got, produced = item
            assert got == step
            m, batch = produced.metrics, produced.batch
            version = trainer["version"]
            stale = sum(version - r.completion.policy_version > k for r in (batch.rows if batch else []))
            if stale_samples == "wait":
                assert stale == 0, (step, version, [r.completion.segments for r in batch.rows])
            else:
                rows_before = len(batch.rows) if batch else 0
                batch, dropped = drop_stale(batch, version, k)
                assert dropped == stale == rows_before - (len(batch.rows) if batch else 0)
                out["dropped"] += dropped
            if batch is not None:
                out["lags"] += [version - r.completion.policy_version for r in batch.rows]
                out["oversized"] += len(batch.rows) > 3 * 2
            out["forced"] += m["partial/forced_groups"]
            out["scored_groups"] += len(produced.generated) // 2
            out["new_groups"] += m["partial/new_groups"]
            time.sleep(rng.random() * 0.002)  # training
            if batch is not None:
                trainer["version"] += 1  # published before the gate opens, as AsyncOrchestrator does
            gate.trained(step, trainer["version"])
    finally:
        gate.close()
        thread.join()
    assert max(out["lags"], default=0) <= k
    # Nothing vanished: every group drawn was scored (trained, filtered or dropped) or is in flight.
    assert out["new_groups"] == out["scored_groups"] + len(partial.in_flight)
    return out


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 3),
    stale_samples=st.sampled_from(["wait", "drop"]),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 12),
    p_stop=st.floats(0.03, 0.5),
    chunk=st.integers(1, 4),
    overprovision=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    filter_groups=st.booleans(),
)
def test_no_trained_sample_is_more_than_k_versions_old_whatever_the_lengths_and_durations(**params: Any) -> None:
    """Real threads, random completion lengths, chunk sizes, pool sizes, durations and skipped
    updates: under "wait" no batch holds a sample more than k versions old (nothing is dropped);
    under "drop" the trainer drops exactly those samples and counts them; no group is ever lost."""
    out = simulate(**params)
    if params["stale_samples"] == "wait":
        assert out["dropped"] == 0
    else:
        assert out["forced"] == 0 and out["oversized"] == 0


def test_long_tails_force_groups_under_wait_and_are_dropped_under_drop() -> None:
    """k = 1 (the producer in step with the trainer, so the run is deterministic) and long
    completions in short chunks: under "wait" groups are finished in time and batches grow past
    prompts_per_step; under "drop" the same tails are carried too long and dropped."""
    common = {
        "k": 1,
        "seed": 7,
        "steps": 10,
        "p_stop": 0.05,
        "chunk": 1,
        "overprovision": 3.0,
        "filter_groups": False,
    }
    wait, drop = simulate(stale_samples="wait", **common), simulate(stale_samples="drop", **common)
    assert wait["forced"] > 0 and wait["oversized"] > 0 and wait["dropped"] == 0
    assert drop["dropped"] > 0 and drop["forced"] == 0


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.slow
@pytest.mark.starter("arithmetic")
def test_the_pool_in_flight_round_trips_and_resumes_exactly(starter: tuple[Any, Any, Any]) -> None:
    """The pool captured before step 3 (with the sampler's position), through JSON, into a fresh
    producer: step 3 there equals step 3 of the run that kept going, row for row and token for
    token, and leaves the same groups in flight."""
    cfg = starter_config("wait")
    model, tokenizer, splits = starter
    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=256)
    with RewardManager(cfg.reward.functions, timeout_s=5, workers=1) as rewards:
        straight = PartialRolloutProducer(starter_producer(cfg, starter, backend, rewards))
        for step in (1, 2):
            straight.produce(step)
            backend.update_weights(model.state_dict(), backend.policy_version + 1)
        saved = json.loads(
            json.dumps({"sampler": straight.sampler.state_dict(), "pool": pool_state(straight.in_flight)})
        )
        assert saved["pool"]["groups"], "nothing in flight to checkpoint"
        for group, original in zip(
            groups_from_state(saved["pool"], splits.train), straight.in_flight, strict=True
        ):
            assert group.prompt is original.prompt and group.started_step == original.started_step
            for c, o in zip(group.completions, original.completions, strict=True):
                assert (c.token_ids, c.logprobs, c.segments, c.finish_reason) == (
                    o.token_ids, o.logprobs, o.segments, o.finish_reason
                )  # fmt: skip
        resumed = PartialRolloutProducer(starter_producer(cfg, starter, backend, rewards))
        resumed.sampler.load_state_dict(saved["sampler"])
        assert resumed.load_state_dict(saved["pool"], splits.train) == (len(straight.in_flight), 0)
        a, b = straight.produce(3), resumed.produce(3)
    backend.close()

    def rows(produced: Any) -> list[tuple]:
        return [
            (r.prompt.uid, r.completion.token_ids, r.completion.logprobs, r.completion.segments, r.reward)
            for r in produced.generated
        ]

    assert rows(a) == rows(b) and len(rows(a)) > 0
    assert [g.prompt.uid for g in straight.in_flight] == [g.prompt.uid for g in resumed.in_flight]
    assert a.metrics["partial/resumed_groups"] == b.metrics["partial/resumed_groups"] > 0


def test_resume_continues_the_partial_rollouts_in_flight(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Cancel a partial-rollout run, resume it: the checkpoint holds the groups in flight, the
    resumed run takes them back, continues them from their tokens with their version tags, and
    every prompt drawn is trained on or still in flight at the end: none is skipped."""
    cfg = small_config(tiny_model_dir, tmp_path / "run", total_steps=500)
    cfg["async"] = {
        "max_staleness": 2,
        "partial_rollouts": True,
        "partial_chunk_tokens": 2,
        "overprovision": 1.0,
    }
    cfg["logging"]["samples_per_step"] = 4096  # every scored rollout, with its prompt uid
    ckpt = cancel_then_resume(cfg, tmp_path, after_step=2, more_steps=3)
    stopped_at = ckpt["step"]
    state = json.loads((Path(ckpt["path"]) / "state.json").read_text())
    saved = state["in_flight"]["groups"]
    assert saved, "nothing was in flight at the checkpoint"

    events = read_events(tmp_path / "run" / "events.jsonl")
    assert any(
        e["type"] == "log" and f"restored {len(saved)} partial rollout groups" in e["message"] for e in events
    )
    assert metrics_by_step(events)[stopped_at + 1]["partial/carried_in_groups"] == len(saved)
    scored: dict[str, list[dict]] = {}
    for e in events:
        if e["type"] == "samples":
            for item in e["items"]:
                scored.setdefault(item["extra"]["prompt_uid"], []).append({"step": e["step"], **item})
    for g in saved:  # "wait" with k = 2: each is finished and trained within the 3 resumed steps
        items = scored.get(g["prompt_uid"], [])
        assert len(items) == cfg["rollout"]["n"] and all(i["step"] > stopped_at for i in items), g[
            "prompt_uid"
        ]
        # The samples do not say which completion is which: compare them as multisets. Each one
        # continued from its saved tokens (at least as long) and kept its oldest version's tag.
        saved_lengths = sorted(sum(n for _, n in c["segments"]) for c in g["completions"])
        assert all(a >= b for a, b in zip(sorted(i["length"] for i in items), saved_lengths, strict=True))
        saved_versions = Counter(c["segments"][0][0] for c in g["completions"] if c["segments"])
        assert not saved_versions - Counter(i["extra"]["policy_version"] for i in items), g

    # No prompt skipped: the prompts drawn (the first `position` of epoch 0) are exactly those
    # scored plus those still in flight in the final checkpoint, each once.
    final = json.loads(
        (sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1] / "state.json").read_text()
    )
    assert final["sampler"]["epoch"] == 0
    drawn = [u for u, items in scored.items() for _ in range(len(items) // cfg["rollout"]["n"])]
    drawn += [g["prompt_uid"] for g in final["in_flight"]["groups"]]
    assert len(drawn) == len(set(drawn)) == final["sampler"]["position"]


def test_a_resume_with_other_settings_restarts_or_refuses_what_cannot_continue() -> None:
    """The pool fits the run that saved it; a resume with a lower max_staleness restarts the groups
    too old for it (keeping their prompts), a lower max_new_tokens ends the completions past it,
    and other data or another rollout.n are refused with the fix."""
    prompts = [Prompt(uid=f"p{i}", text="", raw="", token_ids=[1, 3 + i]) for i in range(4)]

    def producer(n: int, max_new_tokens: int) -> PartialRolloutProducer:
        cfg = build_config(
            {
                "rollout": {"n": n, "max_new_tokens": max_new_tokens},
                "async": {"max_staleness": 2, "partial_rollouts": True},
            }
        )
        rng = random.Random(0)
        return PartialRolloutProducer(
            RolloutProducer(
                cfg,
                sampler=PromptSampler(prompts, shuffle=False),
                backend=ScriptedBackend(rng, 0.5, 0.0),  # type: ignore[arg-type]
                rewards=CoinRewards(rng),  # type: ignore[arg-type]
                pad_id=0,
                decode=str,
            )
        )

    source = producer(2, 10)
    source._top_up(step=1)
    old, fresh = source.in_flight[:2]
    for c in old.completions:
        c.add([5, 6], [-0.5, -0.6], version=3)
    for c in fresh.completions:
        c.add([7, 8, 9, 10, 11, 12], [-0.1] * 6, version=5)
    saved = json.loads(json.dumps(pool_state([old, fresh])))

    target = producer(2, 4)
    assert target.load_state_dict(saved, prompts, oldest_allowed=4) == (2, 1)
    restarted, kept = target.in_flight
    assert restarted.prompt.uid == old.prompt.uid and all(c.token_ids == [] for c in restarted.completions)
    assert all(
        (c.token_ids, c.segments, c.finish_reason) == ([7, 8, 9, 10], [(5, 4)], "length")
        for c in kept.completions
    )
    with pytest.raises(ValueError, match=r"rollout.n is 3; resume with the same rollout.n"):
        producer(3, 10).load_state_dict(saved, prompts)
    with pytest.raises(ValueError, match=r"'p0', which is not in the training data"):
        target.load_state_dict(saved, prompts[1:])
    retokenised = [dataclasses.replace(p, token_ids=[*p.token_ids, 0]) for p in prompts]
    with pytest.raises(ValueError, match=r"which is tokenised differently now"):
        target.load_state_dict(saved, retokenised)
