"""The run page's stage plan (webapp/pages/runs/stage_plan.py): boundaries from data.stages, and no
error from whatever an external run's config holds instead."""

from __future__ import annotations

from typing import Any

import pytest

from webapp.pages.runs.stage_plan import MAX_STAGES, stage_plan


def test_each_stage_gets_its_first_and_last_step() -> None:
    config = {"data": {"stages": [{"name": "add", "steps": 10}, {"name": "count-down", "steps": 20, "task": "countdown"}]}}
    assert stage_plan(config) == [
        {"name": "add", "first": 1, "last": 10},
        {"name": "count-down", "first": 11, "last": 30},
    ]


@pytest.mark.parametrize(
    "config",
    [
        None,
        [],
        {"data": None},
        {"data": {"stages": "a,b"}},
        {"data": {"stages": []}},
        {"data": {"stages": [{"name": "a", "steps": 0}]}},
        {"data": {"stages": [{"name": "a", "steps": True}]}},
        {"data": {"stages": [{"name": "a", "steps": "3"}]}},
        {"data": {"stages": [{"name": "", "steps": 3}]}},
        {"data": {"stages": [{"steps": 3}, "x"]}},
        {"data": {"stages": [{"name": "a", "steps": 1}] * (MAX_STAGES + 1)}},
    ],
)
def test_anything_else_is_no_stages(config: Any) -> None:
    assert stage_plan(config) == []
