"""The compare page: only runs the caller sees, the config diff, the summary of key metrics, the
run search that adds runs, the parts the page swaps in after an add or a drop, and the queries
it costs (constant in the number of runs)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from webapp.analysis import summaries
from webapp.inputs import parse_ids
from webapp.pages.runs.compare import MAX_QUERY, SEARCH_LIMIT, config_diff, flatten, page_config
from webapp.runs.models import MetricPoint, Run
from webapp.teams.models import Project


def _points(run: Run, name: str, values: list[float]) -> None:
    """Points of one metric, and the run's metric summaries as ingest keeps them."""
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, name=name, step=i + 1, value=v, time=now, seq=i + 1)
        for i, v in enumerate(values)
    )
    summaries.rebuild(run.pk)


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
    assert run.name not in page and _data(page)["runs"] == []
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


def test_page_config_keeps_numbers_and_bounds_text() -> None:
    config = {"optimizer": {"lr": 1e-6, "betas": [0.9, 0.99]}, "seed": 3, "on": True, "name": "x" * 500}
    assert page_config(config) == {
        "optimizer.lr": 1e-6,
        "optimizer.betas": "[0.9, 0.99]",
        "seed": 3,
        "on": True,
        "name": "x" * 120,
    }


def test_the_page_data_carries_configs_differing_keys_and_metric_names(
    client_for: Callable[..., Client], viewer: Any, two_runs: tuple[Run, Run]
) -> None:
    a, b = two_runs
    _points(a, "reward/mean", [0.1])
    _points(b, "actor/entropy", [1.0, 0.9])
    Run.objects.filter(pk=b.pk).update(last_seq=7)
    data = _data(client_for(viewer).get(f"/compare/?runs={b.pk},{a.pk}").content.decode())
    assert [r["id"] for r in data["runs"]] == [b.pk, a.pk]  # the link's order: it fixes the colours
    # A live run's socket starts at the cursor read with the page, before its history (compare.js).
    assert [r["last_seq"] for r in data["runs"]] == [7, 0]
    assert data["runs"][0]["config"]["optimizer.lr"] == 123.0
    assert data["runs"][0]["summaries"] == {"actor/entropy": [0.9, 0.9, 1.0]}  # final, min, max
    assert data["runs"][1]["summaries"] == {"reward/mean": [0.1, 0.1, 0.1]}
    assert data["diff_keys"] == ["optimizer.lr"]
    assert data["metric_names"] == ["actor/entropy", "reward/mean"]
    assert data["max_runs"] == 12


# --- the parts the page swaps in --------------------------------------------------------------


def test_the_parts_follow_the_selection_without_the_page_around_them(
    client_for: Callable[..., Client], viewer: Any, two_runs: tuple[Run, Run]
) -> None:
    a, b = two_runs
    response = client_for(viewer).get(f"/compare/parts/?runs={a.pk},{b.pk},x")
    assert response.status_code == 200
    part = response.content.decode()
    assert "<html" not in part and 'id="compare-search"' not in part
    assert f'<tr data-run-id="{a.pk}">' in part and f'<tr data-run-id="{b.pk}">' in part
    assert f'class="secondary run-drop" data-run-id="{b.pk}"' in part
    assert "1 run in the link is not shown" in part
    assert [r["id"] for r in _data(part)["runs"]] == [a.pk, b.pk]


def test_the_parts_need_a_sign_in(client: Client, two_runs: tuple[Run, Run]) -> None:
    assert client.get(f"/compare/parts/?runs={two_runs[0].pk}").status_code == 302
    assert client.get("/compare/search.json?q=lr").status_code == 302


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        assert client.get(url).status_code == 200
    return len(ctx.captured_queries)


def test_the_page_costs_the_same_queries_for_two_runs_and_for_twelve(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    runs = [make_run(name=f"seed-{i}") for i in range(12)]
    for r in runs:
        for name in ("reward/mean", "actor/entropy", "custom/x"):
            _points(r, name, [0.1, 0.2, 0.3])
    client = client_for(viewer)
    ids = [str(r.pk) for r in runs]
    for view in ("/compare/", "/compare/parts/"):
        two = _queries(client, f"{view}?runs={','.join(ids[:2])}")
        twelve = _queries(client, f"{view}?runs={','.join(ids)}")
        assert two == twelve, (view, two, twelve)


# --- the run search ------------------------------------------------------------------------------


def _search(client: Client, **params: str) -> Any:
    response = client.get("/compare/search.json", params)
    return response.status_code, response.json()


@pytest.fixture
def searchable(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> dict[str, Run]:
    def config(lr: float, algo: str) -> dict[str, Any]:
        c = json.loads(json.dumps(valid_config))
        c["optimizer"]["lr"] = lr
        c["odd"] = {"contains": algo}  # a key named like a Django lookup stays a key
        return c

    return {
        "a": make_run(
            name="sweep-lr-a", config=config(1e-6, "grpo"), tags=["baseline", "seed0"], status="succeeded"
        ),
        "b": make_run(name="sweep-lr-b", config=config(2e-6, "grpo"), tags=["seed1"], status="running"),
        "c": make_run(name="other", config=config(1e-6, "dapo"), tags=[], status="failed"),
    }


def test_search_by_name_tag_status_and_config_value(
    client_for: Callable[..., Client], viewer: Any, searchable: dict[str, Run]
) -> None:
    client = client_for(viewer)
    a, b, c = searchable["a"], searchable["b"], searchable["c"]

    def ids(q: str, exclude: str = "") -> list[int]:
        status, body = _search(client, q=q, exclude=exclude)
        assert status == 200, body
        return [r["id"] for r in body["runs"]]

    assert ids("sweep") == [b.pk, a.pk]  # newest first
    assert ids("SWEEP lr-b") == [b.pk]  # every word must match, any case
    assert ids("baseline") == [a.pk] and ids("tag:seed1") == [b.pk] and ids("tag:seed") == []
    assert ids("status:failed") == [c.pk] and ids("running") == [b.pk]
    assert ids("optimizer.lr=1e-6") == [c.pk, a.pk]  # 1e-6 as a number: equals 0.000001
    assert ids("optimizer.lr=0.000001 sweep") == [a.pk]
    assert ids("odd.contains=dapo") == [c.pk]
    assert ids("sweep", exclude=f"{a.pk}") == [b.pk]  # the runs shown already are not offered
    assert ids("") == [c.pk, b.pk, a.pk]
    first = _search(client, q="sweep-lr-a")[1]["runs"][0]
    assert first == {
        "id": a.pk,
        "name": "sweep-lr-a",
        "status": "succeeded",
        "status_badge": a.status_badge,
        "last_step": a.last_step,
        "project": a.project.name,
        "tags": ["baseline", "seed0"],
    }


def test_search_never_shows_runs_of_other_teams(
    client_for: Callable[..., Client], outsider: Any, searchable: dict[str, Run]
) -> None:
    status, body = _search(client_for(outsider), q="sweep")
    assert status == 200 and body["runs"] == []


def test_search_answers_at_most_its_limit(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    for i in range(SEARCH_LIMIT + 3):
        make_run(name=f"many-{i}")
    status, body = _search(client_for(viewer), q="many")
    assert status == 200 and len(body["runs"]) == SEARCH_LIMIT == body["limit"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"q": "a;b=1"}, "'a;b=1' is not a config filter: write key=value"),
        ({"q": "optimizer.lr="}, "is not a config filter"),
        ({"q": "status:sleeping"}, "unknown status 'sleeping': use one of"),
        ({"q": "x" * (MAX_QUERY + 1)}, f"at most {MAX_QUERY} characters"),
        ({"q": "a b c d e f g h i"}, "at most 8 words, got 9"),
        ({"q": "lr", "exclude": "1,x"}, "exclude: 'x' is not a run id"),
    ],
)
def test_bad_searches_are_rejected_with_the_fix(
    client_for: Callable[..., Client], viewer: Any, params: dict[str, str], message: str
) -> None:
    status, body = _search(client_for(viewer), **params)
    assert status == 400 and message in body["detail"], body
