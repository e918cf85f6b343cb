"""Mixture starters: the starter of a run whose ``data.stages`` train different built-in tasks.

A single-task starter scores 0 on the other task, so DAPO's filter drops every group of that
stage (issue 16's continual benchmark learnt nothing in stage 2). A task's companions join its
starter too (arithmetic's: countdown). These tests pin which pairs a run's ``'starter'`` is
trained on, that the single-task starter keeps its path and hash, the mixture's cache key, and
(with a tiny recipe) that a build trains on both tasks and records each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import DataConfig, RunConfig
from engine.models import load_model, load_tokenizer, read_starter_info, resolve_model_path, starter_path
from engine.models.starter import (
    COMPANIONS,
    RECIPES,
    StarterRecipe,
    build_mixture_starter,
    mixture_recipe,
    mixture_starter_path,
    starter_location,
    starter_pairs,
    starter_tasks,
)
from engine.paths import starter_dir

BOTH = [("arithmetic", 1), ("countdown", 1)]


def data(*stages: dict, **over: object) -> DataConfig:
    return DataConfig.model_validate(
        {"source": "builtin", "task": "arithmetic", **over, "stages": list(stages)}
    )


def test_which_pairs_a_runs_starter_is_trained_on() -> None:
    # arithmetic's starter is trained with its companion, countdown at difficulty 1, at every difficulty
    assert COMPANIONS["arithmetic"] == (("countdown", 1),)
    assert starter_tasks(DataConfig()) == BOTH == starter_pairs("arithmetic", 1)
    assert starter_tasks(DataConfig(difficulty=3)) == [("arithmetic", 3), ("countdown", 1)]
    assert starter_tasks(DataConfig(task="countdown", difficulty=3)) == [("countdown", 3)]
    # stages on data.task alone (harder later) keep data.task's starter
    same = data({"name": "a", "steps": 1}, {"name": "b", "steps": 1, "difficulty": 3})
    assert starter_tasks(same) == BOTH
    # different tasks: every stage's pair, sorted and distinct, whatever the order of the stages
    mixed = data(
        {"name": "c", "steps": 1, "task": "countdown", "difficulty": 2},
        {"name": "a", "steps": 1},
        {"name": "c2", "steps": 1, "task": "countdown", "difficulty": 2},
    )
    assert starter_tasks(mixed) == [("arithmetic", 1), ("countdown", 2)]  # countdown is there: no companion
    # stages all on another task than data.task: that task's starter, not data.task's
    other = data({"name": "c", "steps": 1, "task": "countdown"})
    assert starter_tasks(other) == [("countdown", 1)]
    assert starter_location(starter_tasks(other)) == starter_path("countdown", 1)


def test_single_task_path_unchanged_and_mixture_cache_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIBUTARY_DATA_DIR", str(tmp_path))
    single = starter_location([("arithmetic", 1)])  # arithmetic alone: no run resolves to it any more
    assert single.name.startswith("arithmetic-d1-")
    assert starter_path("countdown", 1).name.startswith("countdown-d1-")
    assert starter_path("arithmetic", 1) == mixture_starter_path(BOTH)  # with its companion

    mix = mixture_starter_path(BOTH)
    assert mix.parent == starter_dir()
    assert mix.name.startswith("mix-arithmetic-d1+countdown-d1-")
    assert mixture_starter_path(list(reversed(BOTH))) == mix == starter_location(BOTH + BOTH)  # a set
    assert mixture_starter_path([("arithmetic", 1), ("countdown", 2)]) != mix  # difficulty is in the key
    assert mix.name[-10:] not in (single.name[-10:], starter_path("countdown", 1).name[-10:])

    recipe = mixture_recipe(BOTH)
    assert recipe.max_steps == RECIPES["arithmetic"].max_steps + RECIPES["countdown"].max_steps
    assert recipe.max_new_tokens == max(r.max_new_tokens for r in RECIPES.values())

    with pytest.raises(ValueError, match="at least two"):
        mixture_starter_path([("arithmetic", 1), ("arithmetic", 1)])
    with pytest.raises(ValueError, match="unknown built-in task 'chess'"):
        mixture_starter_path([("arithmetic", 1), ("chess", 1)])
    with pytest.raises(ValueError, match="difficulty must be an integer from 1 to 5"):
        mixture_starter_path([("arithmetic", 1), ("countdown", 9)])


def test_a_staged_run_resolves_starter_to_the_cached_mixture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIBUTARY_DATA_DIR", str(tmp_path))
    cfg = RunConfig.model_validate(
        {
            "model": {"path": "starter"},
            "data": {
                "stages": [
                    {"name": "arithmetic", "steps": 2, "task": "arithmetic"},
                    {"name": "countdown", "steps": 2, "task": "countdown"},
                ]
            },
            "trainer": {"total_steps": 4},
        }
    )
    cached = mixture_starter_path(BOTH)
    cached.mkdir(parents=True)
    (cached / "starter.json").write_text(
        json.dumps({"mixture": BOTH})
    )  # a finished build: reused, not rebuilt
    assert resolve_model_path(cfg.model, cfg.data) == cached


def test_tiny_mixture_build_trains_on_both_tasks(tmp_path: Path) -> None:
    calls: list[tuple] = []
    recipe = StarterRecipe(size="tiny", max_steps=4, eval_every=2, val_size=16, target_accuracy=1.1)
    info = build_mixture_starter(tmp_path / "m", BOTH, recipe=recipe, progress=lambda *a: calls.append(a))
    assert [c[:2] for c in calls] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert info["steps"] == 4  # targets (0.4, 0.2) are out of a 4-step model's reach: the cap stops it
    assert info["mixture"] == [list(p) for p in BOTH]
    by_task = {t["task"]: t for t in info["tasks"]}
    assert sorted(by_task) == ["arithmetic", "countdown"]
    for name, t in by_task.items():
        assert t["sft_examples"] > 0 and t["data"]["task"] == name and t["difficulty"] == 1
        assert t["target_accuracy"] == RECIPES[name].target_accuracy
        assert t["eval_max_new_tokens"] == RECIPES[name].max_new_tokens
        assert 0.0 <= t["eval_accuracy"] <= 1.0 and t["eval_size"] == t["data"]["eval_size"]
    assert info["eval_accuracy"] == min(t["eval_accuracy"] for t in info["tasks"])
    assert [sorted(h["val_accuracy"]) for h in info["history"]] == [["arithmetic-d1", "countdown-d1"]] * 2
    assert read_starter_info(tmp_path / "m") == info
    load_tokenizer(tmp_path / "m")
    load_model(tmp_path / "m")
