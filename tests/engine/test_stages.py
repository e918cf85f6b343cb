"""Continual training (``data.stages``): the config's rules, the staged prompt source and rewards, the
forgetting arithmetic, and whole tiny runs (the switch at the stage's first step, eval per stage seen,
resume mid-stage and across a boundary exactly as an uninterrupted run)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.config import RunConfig, build_config
from engine.contracts import EXIT_SUCCEEDED
from engine.data.stages import StagedRewards, StagedSelector, load_stages, previous_shares
from engine.phases import data_words
from engine.pipeline.stages import forgetting
from engine.rewards import RewardInput
from engine.run import execute
from tests.engine.test_run import metrics_by_step, read_events


def staged(total: int = 4, **over: object) -> dict:
    cfg: dict = {
        "data": {
            "source": "builtin",
            "task": "arithmetic",
            "train_size": 40,
            "eval_size": 4,
            "stages": [
                {"name": "add", "steps": 2},
                {"name": "count-down", "steps": total - 2, "task": "countdown", "eval_size": 3},
            ],
        },
        "trainer": {"total_steps": total, "prompts_per_step": 4, "ppo_mini_batch_size": 2},
    }
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def error_of(raw: dict) -> str:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(raw)
    return str(info.value)


# -- config ------------------------------------------------------------------------------------


def test_stage_config_inherits_and_overrides_data() -> None:
    cfg = RunConfig.model_validate(staged())
    first, second = (s.data_config(cfg.data) for s in cfg.data.stages)
    assert (first.task, first.eval_size, first.train_size) == ("arithmetic", 4, 40)
    assert (second.task, second.eval_size, second.train_size) == ("countdown", 3, 40)
    assert second.stages == []


def test_the_data_phase_names_each_stage_and_its_source() -> None:
    # What the page shows while a staged run loads its prompts: each stage's own task, not only
    # the base data's (which a staged run's first stage may not even train).
    cfg = RunConfig.model_validate(staged())
    assert data_words(cfg.data) == (
        "2 stages: add from built-in task arithmetic, count-down from built-in task countdown"
    )
    assert data_words(cfg.data.stages[1].data_config(cfg.data)) == "built-in task countdown"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"data": {"stages": [{"name": "Add Easy", "steps": 4}]}}, ["data.stages.0.name", "metric names"]),
        ({"data": {"stages": [{"name": "eval/x", "steps": 4}]}}, ["data.stages.0.name"]),
        (
            {"data": {"stages": [{"name": "a", "steps": 2}, {"name": "a", "steps": 2}]}},
            ["data.stages[1].name", "own name"],
        ),
        ({"data": {"stages": [{"name": "a", "steps": 3}]}}, ["add up to 3", "set trainer.total_steps to 3"]),
        (
            {"data": {"stages": [{"name": "a", "steps": 4, "source": "jsonl"}]}},
            ["data.stages[0]", "data.path"],
        ),
        ({"data": {"stages": [{"name": "a", "steps": 0}]}}, ["data.stages.0.steps"]),
        (
            {"replay": {"previous_stages": 0.5}, "data": {"stages": []}},
            ["replay.previous_stages", "data.stages is empty"],
        ),
        ({"replay": {"previous_stages": 0.05}}, ["replay.previous_stages", "rounds to 0"]),
        ({"replay": {"previous_stages": 0.9}}, ["replay.previous_stages", "rounds to 4"]),
        ({"async": {"max_staleness": 1, "partial_rollouts": True}}, ["async.partial_rollouts"]),
        ({"data": {"stage_reference": "previous_stage"}}, ["data.stage_reference", "use_kl_loss"]),
        (
            {"data": {"stage_reference": "previous_stage", "stages": []}, "algorithm": {"use_kl_loss": True}},
            ["data.stage_reference", "needs data.stages"],
        ),
    ],
)
def test_bad_stage_configs_name_the_field_and_the_fix(change: dict, words: list[str]) -> None:
    raw = staged()
    for key, value in change.items():
        raw[key] = {**raw.get(key, {}), **value}
    message = error_of(raw)
    for word in words:
        assert word in message, (word, message)


def test_a_file_stage_needs_its_own_reward_when_the_run_uses_the_task_verifier(tmp_path: Path) -> None:
    raw = staged(model={"path": str(tmp_path)})
    raw["data"]["stages"][1].update(source="jsonl", path=str(tmp_path / "x.jsonl"))
    assert "reward.functions: 'task' is the built-in task's verifier" in error_of(raw)
    raw["data"]["stages"][1]["reward_functions"] = [{"name": "exact_match"}]
    RunConfig.model_validate(raw)


# -- the staged prompt source ---------------------------------------------------------------------


def test_previous_shares_are_even_and_rotate() -> None:
    assert previous_shares(4, 2, 0) == [2, 2]
    assert previous_shares(1, 3, 0) == [1, 0, 0]
    assert previous_shares(1, 3, 2) == [0, 0, 1]
    assert previous_shares(5, 3, 1) == [1, 2, 2]
    totals = Counter()
    for r in range(6):  # over a whole rotation every earlier stage gets the same share
        for j, n in enumerate(previous_shares(2, 3, r % 3)):
            totals[j] += n
    assert totals == {0: 4, 1: 4, 2: 4}


def three_stages(**replay: float) -> RunConfig:
    raw = staged(total=6, replay=replay)
    raw["data"]["stages"].append({"name": "add-hard", "steps": 2, "difficulty": 3})
    raw["data"]["stages"][1]["steps"] = 2
    return RunConfig.model_validate(raw)


def test_the_stage_switches_at_its_first_step_and_the_replayed_fraction_is_exact() -> None:
    cfg = three_stages(previous_stages=0.5)  # round(0.5 x 4) = 2 of each batch from earlier stages
    stages = load_stages(cfg, None)
    selector = StagedSelector(cfg, stages)
    origin = []
    for step in range(1, 7):
        selector.begin_step(step)
        batch = selector.next_batch(4)
        origin.append(Counter(p.uid.split("/")[0] for p in batch))
        metrics = selector.metrics()
        assert metrics["data/stage"] == (step - 1) // 2
        assert metrics["replay/previous_stages_fraction"] == (0.0 if step <= 2 else 0.5)
    assert origin[0] == origin[1] == {"add": 4}
    assert origin[2] == origin[3] == {"count-down": 2, "add": 2}
    # Stage 3: two replayed prompts over two earlier stages, one each.
    assert origin[4] == origin[5] == {"add-hard": 2, "add": 1, "count-down": 1}
    # The statistics go to the stage that owns the prompt.
    uid = next(p.uid for p in stages[1].train)
    selector.observe(uid, [1.0, 0.0], 3)
    assert uid in selector.selectors[1].stats and len(selector.selectors[0].stats) == 0
    with pytest.raises(KeyError):
        selector.observe("elsewhere/x", [1.0], 3)


def test_only_the_first_draw_of_a_step_mixes_in_earlier_stages() -> None:
    """Dynamic sampling draws again within a step when groups are filtered out: those rounds come from
    the current stage alone. Mixing into each of them let the earlier stages' groups, which pass the
    filter more often than a new stage's, make up the whole trained batch (seen in
    bench/data_efficiency.py: stage 2 trained on arithmetic only)."""
    cfg = three_stages(previous_stages=0.5)
    selector = StagedSelector(cfg, load_stages(cfg, None))
    selector.begin_step(3)  # stage 2
    rounds = [Counter(p.uid.split("/")[0] for p in selector.next_batch(4)) for _ in range(3)]
    assert rounds == [{"count-down": 2, "add": 2}, {"count-down": 4}, {"count-down": 4}]
    assert selector.metrics()["replay/previous_stages_fraction"] == 2 / 12
    selector.begin_step(4)  # the next step mixes again
    assert Counter(p.uid.split("/")[0] for p in selector.next_batch(4)) == {"count-down": 2, "add": 2}


@pytest.mark.parametrize("selection", ["uniform", "difficulty_targeted"])
def test_the_selector_state_resumes_exactly_across_a_boundary(selection: str) -> None:
    """With a weighted selection the draws depend on the prompt statistics, which each stage keeps."""
    cfg = three_stages(previous_stages=0.25)  # one replayed prompt of four, rotating over earlier stages
    cfg.data.selection = selection
    stages = load_stages(cfg, None)

    def step_of(selector: StagedSelector, step: int) -> list[str]:
        selector.begin_step(step)
        batch = selector.next_batch(4)
        for i, p in enumerate(batch):  # a made-up score that differs by prompt and step
            selector.observe(p.uid, [float((i + step) % 2), float(len(p.raw) % 2)], step)
        selector.metrics()
        return [p.uid for p in batch]

    straight = StagedSelector(cfg, stages)
    drawn = []
    state = None
    for step in range(1, 7):
        drawn.append(step_of(straight, step))
        if step == 3:
            state = json.loads(json.dumps(straight.state_dict()))
    resumed = StagedSelector(cfg, stages)
    resumed.load_state_dict(state)
    for step in range(4, 7):
        assert step_of(resumed, step) == drawn[step - 1]
    assert len(resumed.stats) == len(straight.stats) and resumed.stats.get(drawn[5][0]) == straight.stats.get(
        drawn[5][0]
    )
    other = RunConfig.model_validate(staged())
    with pytest.raises(ValueError, match=r"same data\.stages"):
        StagedSelector(other, load_stages(other, None)).load_state_dict(state)


def test_each_stage_is_scored_by_its_own_reward() -> None:
    raw = staged()
    raw["data"]["stages"][1]["reward_functions"] = [{"name": "exact_match", "weight": 3.0}]
    cfg = RunConfig.model_validate(raw)
    stages = load_stages(cfg, None)
    a, b = stages[0].train[0], stages[1].train[0]

    def right(p):  # the reference answer as the completion: right by either verifier
        return RewardInput(completion=p.answer, answer=p.answer, prompt=p.raw, metadata=p.metadata)

    with StagedRewards(cfg, stages) as rewards:
        only_b = rewards.score([right(b)])
        assert only_b.total == [3.0] and list(only_b.components) == ["exact_match"]
        mixed = rewards.score([right(a), right(b)])
    assert mixed.total == [1.0, 3.0]
    assert mixed.components == {"task": [1.0, 0.0], "exact_match": [0.0, 1.0]}


def test_forgetting_is_best_so_far_minus_now() -> None:
    best = {"a": 0.75, "b": 0.5}
    out = forgetting(best, {"a": 0.5, "b": 0.25, "c": 0.5}, ["a", "b"])
    assert out == {"forgetting/a": 0.25, "forgetting/b": 0.25, "forgetting/c": 0.0, "forgetting/mean": 0.25}
    assert forgetting(best, {"a": 1.0}, []) == {"forgetting/a": 0.0}  # a new best: nothing forgotten


# -- whole runs ---------------------------------------------------------------------------------


def run_config(model_dir: Path, out: Path, **extra: dict) -> RunConfig:
    raw = staged(total=4, **extra)
    raw.update(
        name="stages",
        output_dir=str(out),
        model={"path": str(model_dir)},
        rollout={"n": 2, "max_new_tokens": 4},
        replay={"previous_stages": 0.5},
        checkpoint={"every_steps": 1, "keep_last": 5},
        logging={"samples_per_step": 8, "progress": "off", "heartbeat_s": 0.5},
    )
    raw["trainer"].update(micro_batch_size=4, ppo_epochs=1, eval_every=3, deterministic=True)
    return build_config(raw)


def test_a_staged_run_switches_evaluates_every_stage_seen_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert execute(run_config(tiny_model_dir, tmp_path / "a")) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    metrics = metrics_by_step(events)
    assert [metrics[s]["data/stage"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    # Eval points: before training, each stage's last step (2, 4) and eval_every (3): the stages seen.
    evaluated = {
        s: sorted(k for k in m if k.endswith("/accuracy") and k.count("/") == 2) for s, m in metrics.items()
    }
    assert evaluated == {
        0: ["eval/add/accuracy"],
        1: [],
        2: ["eval/add/accuracy"],
        3: ["eval/add/accuracy", "eval/count-down/accuracy"],
        4: ["eval/add/accuracy", "eval/count-down/accuracy"],
    }
    for s in (3, 4):  # the run's eval/accuracy is the mean over the stages evaluated
        m = metrics[s]
        assert m["eval/accuracy"] == pytest.approx(
            (m["eval/add/accuracy"] + m["eval/count-down/accuracy"]) / 2
        )
        best = max(metrics[t]["eval/add/accuracy"] for t in (0, 2, 3, 4) if t <= s)
        assert m["forgetting/add"] == pytest.approx(best - m["eval/add/accuracy"])
        assert m["forgetting/mean"] == m["forgetting/add"]
    assert "forgetting/mean" not in metrics[2]  # the first stage has no earlier stage
    # The prompts: stage "add" alone at steps 1-2; then half of each batch replayed from it.
    for e in (e for e in events if e["type"] == "samples"):
        stages = Counter(item["extra"]["prompt_uid"].split("/")[0] for item in e["items"])
        assert stages == ({"add": 8} if e["step"] <= 2 else {"add": 4, "count-down": 4}), e["step"]
    checkpoints = {e["step"]: Path(e["path"]) for e in events if e["type"] == "checkpoint"}

    # Resume mid-stage (step 1: across the boundary at 2) and at the boundary (step 2).
    for at in (1, 2):
        out = tmp_path / f"from-{at}"
        assert execute(run_config(tiny_model_dir, out), resume=str(checkpoints[at])) == EXIT_SUCCEEDED
        again = metrics_by_step(read_events(out / "events.jsonl"))
        assert sorted(again) == list(range(at + 1, 5))
        for s in again:
            assert again[s] == pytest.approx(metrics[s], rel=1e-6, abs=1e-7), (at, s)


def prompts(log: list[dict]) -> dict[int, list[str]]:
    """Each step's prompts, as its samples event lists them."""
    return {e["step"]: [i["extra"]["prompt_uid"] for i in e["items"]] for e in log if e["type"] == "samples"}


def test_an_asynchronous_staged_run_switches_on_time_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The producer thread draws a step ahead: the stage is the step's, not the trainer's."""
    overlap = {"async": {"max_staleness": 1}}
    assert execute(run_config(tiny_model_dir, tmp_path / "a", **overlap)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    metrics = metrics_by_step(events)
    assert [metrics[s]["data/stage"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    for e in (e for e in events if e["type"] == "samples"):
        stages = Counter(item["extra"]["prompt_uid"].split("/")[0] for item in e["items"])
        assert stages == ({"add": 8} if e["step"] <= 2 else {"add": 4, "count-down": 4}), e["step"]
    checkpoint = next(Path(e["path"]) for e in events if e["type"] == "checkpoint" and e["step"] == 2)
    out = tmp_path / "resumed"
    assert execute(run_config(tiny_model_dir, out, **overlap), resume=str(checkpoint)) == EXIT_SUCCEEDED
    # An asynchronous resume generates the step after the checkpoint again with the newer weights
    # (engine/pipeline/async_loop.py), so its numbers differ; the data position is the straight run's.
    resumed = read_events(out / "events.jsonl")
    assert {s: p for s, p in prompts(events).items() if s > 2} == prompts(resumed)
    again = metrics_by_step(resumed)
    assert [again[s]["data/stage"] for s in (3, 4)] == [1, 1]
    assert sorted(k for k in again[4] if k.startswith("forgetting/")) == [
        "forgetting/add",
        "forgetting/count-down",
        "forgetting/mean",
    ]


def test_the_kl_reference_moves_to_the_policy_at_each_stage_start_and_resumes_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """data.stage_reference 'previous_stage': the KL term is zero at a stage's first update (policy =
    reference; one mini-batch, so the loss is computed before the update) and the reference comes back
    from the checkpoint inside a stage."""
    kl = {
        "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"},
        "optimizer": {"lr": 0.02},
        "replay": {"previous_stages": 0.0},
    }

    def config(out: Path) -> RunConfig:
        cfg = run_config(tiny_model_dir, out, **kl)
        cfg.data.stage_reference = "previous_stage"
        cfg.trainer.ppo_mini_batch_size = 4
        return cfg

    assert execute(config(tmp_path / "a")) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    metrics = metrics_by_step(events)
    losses = [metrics[s]["actor/kl_loss"] for s in (1, 2, 3, 4)]
    # Step 1 against the starting model, step 3 against the policy after step 2: both the policy itself.
    assert losses[0] == pytest.approx(0.0, abs=1e-6) and losses[2] == pytest.approx(0.0, abs=1e-6)
    assert losses[1] > 1e-4 and losses[3] > 1e-4, losses
    checkpoints = {e["step"]: Path(e["path"]) for e in events if e["type"] == "checkpoint"}
    assert not (checkpoints[2] / "stage_reference.safetensors").exists()  # the snapshot is step 3's
    assert (checkpoints[3] / "stage_reference.safetensors").is_file()
    for at in (2, 3):  # at the boundary (the resume takes the snapshot) and inside the stage (the file)
        out = tmp_path / f"from-{at}"
        assert execute(config(out), resume=str(checkpoints[at])) == EXIT_SUCCEEDED
        again = metrics_by_step(read_events(out / "events.jsonl"))
        for s in again:
            assert again[s] == pytest.approx(metrics[s], rel=1e-6, abs=1e-7), (at, s)
