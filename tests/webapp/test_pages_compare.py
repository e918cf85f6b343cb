"""The compare page: only runs the caller sees, the config diff, the summary of key metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.inputs import parse_ids
from webapp.pages.runs.compare import config_diff, flatten
from webapp.runs.models import MetricPoint, Run
from webapp.teams.models import Project


def _points(run: Run, name: str, values: list[float]) -> None:
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, name=name, step=i + 1, value=v, time=now, seq=i + 1)
        for i, v in enumerate(values)
    )


def _data(page: str) -> dict[str, Any]:
    match = re.search(r'<script id="compare-data" type="application/json">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


# --- pure helpers -------------------------------------------------------------------------------


def test_flatten_uses_dotted_keys_and_keeps_lists_whole() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
        "f": None,
    }


def test_config_diff_marks_differences_and_missing_keys() -> None:
    rows = config_diff(
        [
            {"trainer": {"lr": 1e-6, "steps": 10}, "name": "a", "tags": [1]},
            {"trainer": {"lr": 2e-6, "steps": 10}, "name": "a", "extra": True},
        ]
    )
    by_key = {r["key"]: r for r in rows}
    assert list(by_key) == ["trainer.lr", "trainer.steps", "name", "tags", "extra"]
    assert by_key["trainer.lr"] == {"key": "trainer.lr", "values": ["1e-06", "2e-06"], "differs": True}
    assert by_key["trainer.steps"]["differs"] is False and by_key["name"]["differs"] is False
    assert by_key["tags"]["values"] == ["[1]", "—"] and by_key["tags"]["differs"]
    assert by_key["extra"]["values"] == ["—", "true"] and by_key["extra"]["differs"]


def test_config_diff_tells_types_apart() -> None:
    rows = config_diff([{"x": 1}, {"x": "1"}, {"x": 1.0}])
    assert rows[0]["differs"] is True


def test_parse_ids() -> None:
    assert parse_ids(["3, 1,x,3,,-2"]) == ([3, 1], ["x", "-2"])
    assert parse_ids([""]) == ([], [])
    assert parse_ids(["4,1", " 1, y ", "5"]) == ([4, 1, 5], ["y"])  # repeated form fields


# --- the page ------------------------------------------------------------------------------------


@pytest.fixture
def two_runs(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> tuple[Run, Run]:
    a = make_run(name="lr-small", config=valid_config)
    changed = json.loads(json.dumps(valid_config))
    changed["optimizer"]["lr"] = 123.0
    b = make_run(name="lr-big", config=changed)
    return a, b


def test_compare_needs_a_sign_in(client: Client, two_runs: tuple[Run, Run]) -> None:
    assert client.get(f"/compare/?runs={two_runs[0].pk}").status_code == 302


def test_invisible_runs_are_dropped_with_a_note(
    client_for: Callable[..., Client], viewer: Any, two_runs: tuple[Run, Run], other_team: Any
) -> None:
    a, b = two_runs
    hidden_project = Project.objects.create(team=other_team, name="Secret", slug="secret")
    secret = Run.objects.create(project=hidden_project, name="top-secret-run", config={})
    page = client_for(viewer).get(f"/compare/?runs={a.pk},{secret.pk},{b.pk},999999,junk").content.decode()
    assert "top-secret-run" not in page and f'data-run-id="{secret.pk}"' not in page
    assert "3 runs in the link are not shown" in page
    assert [r["id"] for r in _data(page)["runs"]] == [a.pk, b.pk]
    assert f'href="/api/runs/{a.pk}/metrics.csv"' in page and f'href="/api/runs/{b.pk}/metrics.csv"' in page


def test_no_visible_run_is_an_empty_state(client_for: Callable[..., Client], outsider: Any, run: Run) -> None:
    response = client_for(outsider).get(f"/compare/?runs={run.pk}")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="compare-empty"' in page and "1 run in the link is not shown" in page
    assert run.name not in page and "compare-data" not in page
    assert 'id="compare-empty"' in client_for(outsider).get("/compare/").content.decode()


def test_config_diff_table_on_the_page(
    client_for: Callable[..., Client], viewer: Any, two_runs: tuple[Run, Run]
) -> None:
    a, b = two_runs
    page = client_for(viewer).get(f"/compare/?runs={a.pk},{b.pk}").content.decode()
    assert 'id="only-diff" checked' in page and 'class="config-diff only-diff"' in page
    row = re.search(r'<tr class="differs" data-key="optimizer.lr">(.*?)</tr>', page, re.S)
    assert row and "123.0" in row.group(1)
    # only optimizer.lr differs; the rest is there, hidden by the toggle
    assert '<tr class="same" data-key="trainer.total_steps">' in page
    assert "1 key differs" in page


def test_identical_configs(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    a, b = make_run(name="a"), make_run(name="b")
    page = client_for(viewer).get(f"/compare/?runs={a.pk},{b.pk}").content.decode()
    assert 'id="diff-none"' in page and "0 keys differ" in page


def test_summary_of_final_and_best(
    client_for: Callable[..., Client], viewer: Any, two_runs: tuple[Run, Run]
) -> None:
    a, b = two_runs
    _points(a, "reward/mean", [0.1, 0.9, 0.5])
    _points(b, "reward/mean", [0.2, 0.3])
    _points(a, "custom/thing", [1.0])
    page = client_for(viewer).get(f"/compare/?runs={a.pk},{b.pk}").content.decode()
    row = re.search(r'<tr data-metric="reward/mean">(.*?)</tr>', page, re.S)
    assert row
    cells = re.findall(r"<td>(.*?)</td>", row.group(1), re.S)
    assert 'title="final">0.5000<' in cells[0] and "best 0.9000" in cells[0]
    assert 'title="final">0.3000<' in cells[1] and "best 0.3000" in cells[1]
    assert 'data-metric="custom/thing"' not in page  # only key metrics are summarised
    assert 'data-metric="eval/accuracy"' not in page  # nobody logged it


def test_compare_escapes_names_and_config_values(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    evil = "<script>alert(1)</script>"
    a = make_run(name=evil, config={"data": {"path": evil}})
    b = make_run(name="plain", config={"data": {"path": "ok"}})
    page = client_for(viewer).get(f"/compare/?runs={a.pk},{b.pk}").content.decode()
    assert evil not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert _data(page)["runs"][0]["name"] == evil
