"""The runs table's config values as rows (issue 18, ``ConfigValue``): written by every way a run
is created and when its config changes, backfilled by the migration, equal where JSON values are
equal, listed by the key picker, and each group of a grouped table linking to exactly its runs,
whatever its value: an object, a list, null, a text longer than a filter, or no value."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.apps import apps
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from webapp.analysis import config_keys, table
from webapp.analysis.models import ConfigValue
from webapp.runs.external import create_external_run
from webapp.runs.imports import import_verl_run
from webapp.runs.models import Run
from webapp.runs.services import create_run, fork_run
from webapp.teams.models import Project

HTMX = {"HTTP_HX_REQUEST": "true"}


def _stored(run: Run) -> dict[str, tuple[str, str, float | None]]:
    return {v.key: (v.kind, v.text, v.number) for v in ConfigValue.objects.filter(run=run).order_by("key")}


def _expected(config: dict[str, Any]) -> dict[str, tuple[str, str, float | None]]:
    out = {}
    for path, value, _leaf in config_keys.nodes(config):
        t = config_keys.typed(value)
        out[path] = (t.kind, t.text, t.number)
    return out


# --- values kept ----------------------------------------------------------------------------------


def test_every_way_of_creating_a_run_keeps_its_config_values(
    project: Project, member: Any, valid_config: dict[str, Any]
) -> None:
    launched = create_run(project, member, valid_config)
    forked = fork_run(launched, member, {"optimizer": {"lr": 3e-6}})
    external, _ = create_external_run(
        project, member, name="script", config={"lr": 0.1, "model": {"name": "m"}}, tags=[], client_id=None
    )
    imported, _ = import_verl_run(project, member, name="verl", metrics=b"", rollouts={})
    for run in (launched, forked, external, imported):
        run.refresh_from_db()
        assert _stored(run) == _expected(run.config) and _stored(run), run.name
    assert _stored(forked)["optimizer.lr"] == ("num", "3e-06", 3e-6)
    assert _stored(external)["model"] == ("dict", '{"name":"m"}', None)
    assert ConfigValue.objects.filter(run=external, key="model.name", leaf=True).exists()


def test_a_changed_config_rewrites_the_values_and_other_saves_leave_them(
    make_run: Callable[..., Run],
) -> None:
    run = make_run(config={"a": {"b": 1}, "c": "x"})
    before = list(ConfigValue.objects.filter(run=run).values_list("pk", flat=True))
    run.notes = "n"
    run.save(update_fields=["notes"])
    assert list(ConfigValue.objects.filter(run=run).values_list("pk", flat=True)) == before
    run.config = {"a": {"b": 2}, "d": [1, 2]}
    run.save(update_fields=["config"])
    assert _stored(run) == {
        "a": ("dict", '{"b":2}', None),
        "a.b": ("num", "2", 2.0),
        "d": ("list", "[1,2]", None),
    }


def test_the_migration_backfills_the_values_of_stored_runs(make_run: Callable[..., Run]) -> None:
    configs = [{"a": {"b": i, "s": "t" * 1500}, "odd key": {"x": 1}, "n": None} for i in range(3)]
    runs = [make_run(name=f"r{i}", config=c) for i, c in enumerate(configs)]
    expected = [_stored(r) for r in runs]
    ConfigValue.objects.all().delete()
    migration = __import__("webapp.analysis.migrations.0002_config_values", fromlist=["backfill"])
    migration.backfill(apps, None)
    assert [_stored(r) for r in runs] == expected
    assert "odd key" not in expected[0] and len(expected[0]["a.s"][1]) == config_keys.TEXT_CHARS


def test_equal_json_values_share_a_digest_and_others_do_not() -> None:
    digest = lambda v: config_keys.typed(v).digest  # noqa: E731
    assert digest(8) == digest(8.0) != digest("8") != digest(True)
    assert digest(1) != digest(True) and digest(0) != digest(False) and digest(None) != digest("null")
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1}) != digest([1, 2])
    assert digest("x" * 5000) != digest("x" * 5000 + "y")  # past the kept text: still apart
    assert digest(10**400) != digest(10**400 + 1)  # too large for a float: compared as text
    assert config_keys.loose_digests("8") == [digest("8"), digest(8)]
    assert config_keys.loose_digests("grpo") == [digest("grpo")]


# --- the table reads them -----------------------------------------------------------------------


def test_the_key_picker_lists_the_leaf_keys_of_every_run_of_the_project(
    make_run: Callable[..., Run], project: Project, member: Any
) -> None:
    other_project = Project.objects.create(team=project.team, name="Other", slug="other")
    make_run(name="old", config={"old": {"only": 1}, "shared": 1})
    for i in range(3):
        make_run(name=f"new{i}", config={"shared": 2, "empty": {}, "obj": {"leaf": [1]}})
    Run.objects.create(project=other_project, created_by=member, name="x", config={"elsewhere": 1})
    keys = table.config_key_list(project.pk)
    assert keys == ["empty", "obj.leaf", "old.only", "shared"]  # objects with keys are no column


@pytest.fixture
def odd_values(make_run: Callable[..., Run]) -> dict[str, list[Run]]:
    """Runs whose ``x`` is an object (two spellings of one), a list, null, an empty object, texts
    longer than a filter's value and than the kept text, the text "8", the number 8 (and 8.0), or
    missing; ``y`` is the same for all."""
    long_a, long_b = "L" * 1200, "L" * 1200 + "M"  # the same kept text, different values
    values: dict[str, list[Any]] = {
        "object": [{"b": 2, "a": [1, "z"]}, {"a": [1, "z"], "b": 2}],
        "list": [[1, 2]],
        "null": [None],
        "empty": [{}],
        "long": ["q" * 300],
        "long_a": [long_a],
        "long_b": [long_b],
        "text8": ["8"],
        "number8": [8, 8.0],
        "missing": [],
    }
    out: dict[str, list[Run]] = {}
    for label, xs in values.items():
        configs = [{"x": x, "y": 1} for x in xs] or [{"y": 1}]
        out[label] = [make_run(name=f"{label}-{i}", config=c) for i, c in enumerate(configs)]
    return out


def _row_ids(html: str) -> set[int]:
    return {int(m) for m in re.findall(r'<tr id="run-row-\d+" data-run-id="(\d+)"', html)}


def test_each_group_links_to_exactly_its_runs_whatever_its_value(
    client_for: Callable[..., Client], member: Any, project: Project, odd_values: dict[str, list[Run]]
) -> None:
    client = client_for(member)
    html = client.get(f"/projects/{project.pk}/?col=config:y&group=x").content.decode()
    groups = re.findall(
        r'<tr class="group-row".*?<td class="group-key">(.*?)</td>.*?hx-get="([^"]+)".*?'
        r"<summary>(\d+) runs?</summary>.*?<a href=\"([^\"]+)\"",
        html,
        re.S,
    )
    assert len(groups) == len(odd_values)
    found: dict[frozenset[int], str] = {}
    for shown, expand_url, n, runs_url in groups:
        expand = client.get(expand_url.replace("&amp;", "&"), **HTMX)
        assert expand.status_code == 200, (shown, expand.content.decode()[:500])
        listed = {int(i) for i in re.findall(r'<li data-run-id="(\d+)"', expand.content.decode())}
        linked = client.get(runs_url.replace("&amp;", "&"), **HTMX)
        assert linked.status_code == 200, (shown, linked.content.decode()[:500])
        assert listed == _row_ids(linked.content.decode()) and len(listed) == int(n), shown
        found[frozenset(listed)] = shown
    expected = {frozenset(r.pk for r in runs): label for label, runs in odd_values.items()}
    assert set(found) == set(expected)  # every group is exactly one kind of value's runs
    shown_as = {expected[ids]: text for ids, text in found.items()}
    assert shown_as["missing"] == "not set" and shown_as["null"] == "null"
    assert shown_as["number8"] == "8" and shown_as["text8"] == "8" and shown_as["list"] == "[1,2]"


def test_config_filters_read_json_equality_and_exact_values(
    client_for: Callable[..., Client], member: Any, project: Project, odd_values: dict[str, list[Run]]
) -> None:
    client = client_for(member)

    def ids(where: str) -> set[int]:
        response = client.get(f"/projects/{project.pk}/", {"where": where}, **HTMX)
        assert response.status_code == 200, response.content.decode()[:500]
        return _row_ids(response.content.decode())

    def of(*labels: str) -> set[int]:
        return {r.pk for label in labels for r in odd_values[label]}

    assert ids("config:x|eq|8") == of("text8", "number8")  # the text or the number
    assert ids('config:x|is|"8"') == of("text8") and ids("config:x|is|8.0") == of("number8")
    assert ids('config:x|eq|{"a":[1,"z"],"b":2}') == of("object")
    assert ids("config:x|eq|null") == of("null") and ids("config:x|missing|") == of("missing")
    assert ids("config:x|contains|QQQ") == of("long")  # any case
    assert ids("config:x|is|#" + config_keys.typed("L" * 1200).digest) == of("long_a")
    response = client.get(f"/projects/{project.pk}/", {"where": "config:x|is|grpo"}, **HTMX)
    assert response.status_code == 400 and "is not a JSON value" in response.content.decode()
    # An object path is a column too: its cell shows the JSON, sorted by its text.
    response = client.get(f"/projects/{project.pk}/", {"col": "config:x", "sort": "config:x"}, **HTMX)
    assert response.status_code == 200 and "[1,2]" in response.content.decode()


def test_a_groups_expanded_list_reads_no_trend_and_no_alert(
    client_for: Callable[..., Client], member: Any, project: Project, odd_values: dict[str, list[Run]]
) -> None:
    client = client_for(member)
    url = f"/projects/{project.pk}/?col=config:y&group=x&where=config:x|eq|8&fragment=group"
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url, **HTMX)
    assert response.status_code == 200 and response.content.decode().count("<li data-run-id=") == 3
    sql = " ".join(q["sql"] for q in ctx.captured_queries)
    assert "runs_metricpoint" not in sql and "alerts_alert" not in sql


def test_a_config_cell_is_escaped_and_a_cut_value_keeps_its_text_in_the_title(
    client_for: Callable[..., Client], member: Any, project: Project, make_run: Callable[..., Run]
) -> None:
    make_run(name="html", config={"x": '<script>alert("x")</script>', "y": "w" * 100})
    response = client_for(member).get(f"/projects/{project.pk}/?col=config:x&col=config:y", **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "<script>alert" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert f'title="{"w" * 100}">{"w" * 77}...</td>' in html
