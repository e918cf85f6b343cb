"""Success replay (``replay.successes``, engine/data/success_replay.py): stored successes join
all-failed groups only, bounded per step and by age, marked in the samples event, corrected by the
learner, and restored exactly from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.batch import Rollout
from engine.config import ConfigError, build_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data import Prompt
from engine.data.success_replay import SuccessBank
from engine.pipeline.producer import StepTally
from engine.rewards import RewardResult
from engine.rollout import Completion
from engine.run import execute
from tests.engine.test_run import metrics_by_step, read_events, small_config

PROMPTS = {uid: Prompt(uid=uid, text="", raw="", token_ids=[5, i + 6]) for i, uid in enumerate("abcd")}


def group(uid: str, accs: list[float], step: int, version: int) -> list[Rollout]:
    prompt = PROMPTS[uid]
    return [
        Rollout(
            prompt,
            list(prompt.token_ids),
            Completion([9, 10 + j], [-0.5, -0.25 - j], f"c{j}", "stop", version),
            acc,
            {"task": acc},
            group=f"{step}:{uid}",
        )
        for j, acc in enumerate(accs)
    ]


def bank(**kw: int) -> SuccessBank:
    return SuccessBank(
        per_prompt=kw.get("per_prompt", 1),
        prompts=kw.get("prompts", 100),
        max_age=kw.get("max_age", 3),
        per_step=kw.get("per_step", 2),
        threshold=1.0,
    )


def test_a_success_joins_only_all_failed_groups_of_its_prompt() -> None:
    b = bank()
    # Step 1: a and b succeed once each (stored), c fails with nothing stored: nothing joins.
    first = [group("a", [0, 1, 0], 1, 0), group("b", [1, 0], 1, 0), group("c", [0, 0], 1, 0)]
    assert b.process(first, "task", version=0) == []
    assert b.metrics()["replay/success_failed_groups"] == 1.0
    # Step 2: a fails (a's success joins), b succeeds (nothing joins: it has its own), c fails (none stored).
    second = [group("a", [0, 0, 0, 0], 2, 1), group("b", [0, 1], 2, 1), group("c", [0, 0, 0], 2, 1)]
    joined = b.process(second, "task", version=1)
    assert len(joined) == 1
    row = joined[0]
    assert row.replayed and row.group == "2:a" and row.advantage is None
    assert row.completion.token_ids == [9, 11] and row.completion.logprobs == [-0.5, -1.25]  # a's success
    assert row.completion.policy_version == 0 and row.reward == 1.0
    m = b.metrics()
    assert m["replay/success_injected"] == 1.0 and m["replay/success_age_max"] == 1.0
    assert m["replay/success_failed_groups"] == 2.0 and m["replay/success_bank_prompts"] == 2.0
    # The filter keeps the group (it has variance); frac_reward_zero_std counts it (as generated).
    cfg = build_config({"algorithm": {"filter_groups": {"enable": True, "metric": "acc"}}})
    tally = StepTally(cfg, want=4)
    rows = second[0]
    tally.add_scored(rows, RewardResult([r.reward for r in rows], {"task": [r.reward for r in rows]}), joined)
    assert [len(g) for g in tally.kept] == [5] and tally.kept[0][-1] is row and tally.zero_std_groups == 1
    assert tally.generated == rows and tally.injected == joined


def test_injections_are_bounded_per_step_and_by_age() -> None:
    b = bank(per_step=2, max_age=2)
    b.process([group(u, [1, 0], 1, 0) for u in "abcd"], "task", version=0)
    b.metrics()
    joined = b.process([group(u, [0, 0], 2, 1) for u in "abcd"], "task", version=1)
    assert [r.group for r in joined] == ["2:a", "2:b"]  # the step's bound: 2
    assert b.metrics()["replay/success_injected"] == 2.0
    joined = b.process([group(u, [0, 0], 3, 3) for u in "cd"], "task", version=3)
    assert [r.group for r in joined] == [] and len(b) == 2  # 3 versions old > max_age 2: dropped
    assert b.metrics()["replay/success_bank_prompts"] == 2.0


def test_the_bank_keeps_the_newest_and_evicts_the_oldest_prompt() -> None:
    b = bank(per_prompt=2, prompts=2)
    b.process([group("a", [1, 1, 1], 1, 0)], "task", version=0)  # three successes: the last two kept
    assert [r.completion.token_ids for r in b.entries["a"]] == [[9, 11], [9, 12]]
    b.process([group("b", [1], 2, 1), group("c", [1], 2, 1)], "task", version=1)
    assert list(b.entries) == ["b", "c"]  # a, stored longest ago, left


def test_the_bank_round_trips_exactly() -> None:
    b = bank(per_prompt=2)
    b.process([group("a", [1, 0, 1], 1, 0), group("c", [0, 1], 1, 2)], "task", version=2)
    state = json.loads(json.dumps(b.state_dict()))
    other = bank(per_prompt=2)
    other.load_state_dict(state, PROMPTS.values())
    assert other.state_dict() == b.state_dict()
    assert [(r.completion.logprobs, r.completion.policy_version) for r in other.entries["a"]] == [
        ([-0.5, -0.25], 0),
        ([-0.5, -2.25], 0),
    ]
    with pytest.raises(ValueError, match="not in the training data"):
        bank().load_state_dict(state, [PROMPTS["c"]])


def test_the_config_defaults_off_and_bounds_its_fields(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = small_config(tiny_model_dir, tmp_path)
    assert build_config(raw).replay.successes is False
    for replay, message in [
        ({"successes_per_step": 0}, "replay.successes_per_step"),
        ({"success_max_age": 0}, "success_max_age"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(raw | {"replay": {"successes": True, **replay}})


# ----------------------------------------------------------------------------- runs


def success_config(model_dir: Path, out: Path, **extra: object) -> dict:
    """A digit anywhere in the completion is a success, which the random tiny policy has now and then:
    some groups succeed (stored), and some later groups of the same 8 prompts fail entirely."""
    raw = small_config(model_dir, out, total_steps=4)
    raw["data"]["train_size"] = 8
    raw["reward"] = {"functions": [{"name": "format", "params": {"regex": "[0-9]"}}]}
    raw["replay"] = {"successes": True, "successes_per_step": 1, "success_max_age": 8}
    raw["async"] = {"importance_cap": 2.0}
    raw["trainer"] |= {"ppo_epochs": 1, "eval_every": 0}  # seconds, not minutes, on a busy 2-core machine
    raw["algorithm"]["use_kl_loss"] = False
    return raw | extra


def check_success_run(events: list[dict]) -> dict[int, dict[str, float]]:
    metrics = metrics_by_step(events)
    assert all(metrics[s]["replay/success_injected"] <= 1 for s in (1, 2, 3, 4))  # successes_per_step
    injected = sum(metrics[s]["replay/success_injected"] for s in (1, 2, 3, 4))
    assert injected >= 1
    marked = [i for e in events if e["type"] == "samples" for i in e["items"] if i["extra"].get("replayed")]
    for s in (1, 2, 3, 4):
        if metrics[s]["replay/success_injected"]:
            assert 0.0 < metrics[s]["replay/ess"] <= 1.0 + 1e-9
    assert all(i["extra"]["replayed"] == "success" and i["reward"] == 1.0 for i in marked)
    return metrics


def test_a_sync_run_injects_successes_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = success_config(tiny_model_dir, tmp_path / "a")
    raw["logging"]["samples_per_step"] = 40  # every row: the replayed one is among them
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    metrics = check_success_run(events)
    marked = [i for e in events if e["type"] == "samples" for i in e["items"] if i["extra"].get("replayed")]
    assert len(marked) == sum(metrics[s]["replay/success_injected"] for s in (1, 2, 3, 4))
    for item in marked:  # it joined a group whose generated completions all failed
        same = [
            i
            for e in events
            if e["type"] == "samples"
            for i in e["items"]
            if i["extra"]["group"] == item["extra"]["group"] and not i["extra"].get("replayed")
        ]
        assert same and all(i["reward"] < 1.0 for i in same)
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    resumed_raw = success_config(tiny_model_dir, tmp_path / "b")
    resumed_raw["logging"]["samples_per_step"] = 40
    assert execute(build_config(resumed_raw), resume=checkpoints[0]["path"]) == EXIT_SUCCEEDED
    resumed = read_events(tmp_path / "b" / "events.jsonl")
    again = metrics_by_step(resumed)
    for s in (3, 4):
        assert again[s] == pytest.approx(metrics[s], rel=1e-6, abs=1e-7), s
    final_a = json.loads((Path(checkpoints[1]["path"]) / "state.json").read_text())["success_replay"]
    ckpt_b = [e for e in resumed if e["type"] == "checkpoint"][-1]
    final_b = json.loads((Path(ckpt_b["path"]) / "state.json").read_text())["success_replay"]
    assert final_a["prompts"] and final_b == final_a


@pytest.mark.parametrize(
    "mode",
    [
        {"max_staleness": 1},
        {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 3},
        {"periodic": True, "periodic_slices": 2},
    ],
    ids=["async", "partial", "periodic"],
)
def test_async_runs_inject_successes(tiny_model_dir: Path, tmp_path: Path, mode: dict) -> None:
    """With the frontier schedule too (both controls of issue 16 at once); an injected row is old by
    design and passes the staleness bound (replay.success_max_age bounds it)."""
    raw = success_config(tiny_model_dir, tmp_path / "run")
    raw["async"] |= mode
    raw["rollout"] |= {"n_schedule": "frontier", "n_min": 2, "n_max": 6}
    raw["checkpoint"] = {"every_steps": 0}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    check_success_run(read_events(tmp_path / "run" / "events.jsonl"))
