"""The compare page's review findings (issue 18): the metric names in one query whatever the
number of runs and names, the search's ``tag:`` as an exact tag (non-ASCII too, on SQLite and on
PostgreSQL), a page number past any table bounded before it reaches the database, and runs
added without JavaScript (a plain GET form: the search, then an Add button per run found)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.analysis import summaries
from webapp.pages.runs.compare import MAX_RUNS, metric_name_union
from webapp.runs.models import MetricPoint, Run


def _points(run: Run, names: list[str], steps: int = 3) -> None:
    """``steps`` points of each of ``names``, and the run's summaries as ingest keeps them."""
    now = timezone.now()
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, name=name, step=s, value=float(s), time=now, seq=k * steps + s)
        for k, name in enumerate(names)
        for s in range(1, steps + 1)
    )
    summaries.rebuild(run.pk)


def _data(page: str) -> dict[str, Any]:
    match = re.search(r'<script id="compare-data" type="application/json">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


# --- 1. the metric names: one query -------------------------------------------------------------


@pytest.mark.parametrize(("n_runs", "n_names"), [(1, 1), (2, 3), (8, 30)])
def test_metric_names_are_one_query_whatever_the_runs_and_names(
    make_run: Callable[..., Run], django_assert_num_queries: Any, n_runs: int, n_names: int
) -> None:
    """Was one index probe per distinct name (30 names: 31 queries, each a full scan of the
    points on PostgreSQL when ``run IN (...)`` spans several runs); now the summaries, once."""
    runs = [make_run(name=f"r{i}") for i in range(n_runs)]
    logged: set[str] = set()
    for i, r in enumerate(runs):
        # Runs log overlapping name sets: the union is every name once, sorted.
        names = [f"m/{(i + k) % n_names:02d}" for k in range(max(1, n_names - 1))]
        _points(r, names)
        logged.update(names)
    with django_assert_num_queries(1):
        assert metric_name_union(runs) == sorted(logged)
    with django_assert_num_queries(0):
        assert metric_name_union([]) == []


def test_metric_names_sorted_as_before(make_run: Callable[..., Run]) -> None:
    """The order the page used (the database's name order): the panels and the datalist follow it."""
    a, b = make_run(name="a"), make_run(name="b")
    _points(a, ["reward/mean", "actor/entropy"])
    _points(b, ["Zeta", "actor/entropy", "custom/x"])
    expected = list(
        MetricPoint.objects.filter(run__in=[a, b]).order_by("name").values_list("name", flat=True).distinct()
    )
    assert metric_name_union([a, b]) == expected
    assert set(expected) == {"reward/mean", "actor/entropy", "Zeta", "custom/x"}


# --- 5. tag: is an exact tag ---------------------------------------------------------------------


def test_search_tag_is_exact_and_non_ascii(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    """``tag:`` was ``icontains`` on the JSON text of ``json.dumps(tag)``: any case, and on
    PostgreSQL (jsonb keeps ``ï`` as it is, json.dumps writes ``\\u00ef``) never a non-ASCII tag."""
    accented = make_run(name="a", tags=["naïve-β", "Baseline"])
    plain = make_run(name="b", tags=["naive", "baseline"])
    client = client_for(viewer)

    def ids(q: str) -> list[int]:
        response = client.get("/compare/search.json", {"q": q})
        assert response.status_code == 200, response.content
        return [r["id"] for r in response.json()["runs"]]

    assert ids("tag:naïve-β") == [accented.pk]
    assert ids("tag:Baseline") == [accented.pk] and ids("tag:baseline") == [plain.pk]
    assert ids("tag:naive") == [plain.pk] and ids("tag:naïve") == []  # a whole tag, not a part
    assert ids('tag:"naive"') == []  # quotes are part of the tag asked for, not JSON syntax


# --- 6. a page number past any table ----------------------------------------------------------------


@pytest.mark.parametrize("extra", ["", "&where=config:algorithm.name|eq|grpo", "&group=algorithm.name"])
def test_a_huge_page_number_is_the_last_page(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run], extra: str
) -> None:
    """``page=10**30`` made OFFSET overflow a bigint on PostgreSQL (a 503 from the one-pass
    count of a filtered or grouped table): the number is bounded first, and past the end is the
    last page, as for any page number past the end."""
    run = make_run(name="only-run", config={"algorithm": {"name": "grpo"}})
    # As the table's own filter form asks (htmx): a full page with a column filter first
    # redirects to the saved view's address, without the page number.
    response = client_for(viewer).get(
        f"{run.project.get_absolute_url()}?page={10**30}{extra}", headers={"HX-Request": "true"}
    )
    assert response.status_code == 200, response.content.decode()[:2000]
    # the run's row, or its group's (the grouped table's rows load with the group)
    assert ("grpo" if "group=" in extra else "only-run") in response.content.decode()


# --- 7. adding runs without JavaScript -------------------------------------------------------------


def test_runs_are_added_without_javascript(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    """The pick section is a GET form (``runs`` kept in a hidden field): submitting the search
    renders the runs found with an Add button each (``add=<id>``); the add answers with a
    redirect to the link of the new selection, the search kept so more runs can be added."""
    a = make_run(name="sweep-a")
    b = make_run(name="sweep-b")
    c = make_run(name="other-c")
    client = client_for(viewer)
    page = client.get(f"/compare/?runs={a.pk}&q=sweep").content.decode()
    form = re.search(r'<form[^>]*id="compare-pick-form"[^>]*>(.*?)</form>', page, re.S)
    assert form, "the pick section is a form"
    assert 'method="get"' in form.group(0) and 'action="/compare/"' in form.group(0)
    assert f'<input type="hidden" name="runs" value="{a.pk}">' in form.group(1)
    assert re.search(r'<input type="search"[^>]*name="q"[^>]*value="sweep"', form.group(1))
    assert f'<button type="submit" name="add" value="{b.pk}"' in form.group(1)  # found, not shown yet
    assert f'name="add" value="{a.pk}"' not in form.group(1)  # shown already: not offered
    assert f'value="{c.pk}"' not in form.group(1)  # does not match

    response = client.get("/compare/", {"runs": str(a.pk), "q": "sweep", "add": str(b.pk)})
    assert response.status_code == 302
    assert response["Location"] == f"/compare/?runs={a.pk},{b.pk}&q=sweep"
    page = client.get(response["Location"]).content.decode()
    assert [r["id"] for r in _data(page)["runs"]] == [a.pk, b.pk]
    assert "No run matches." in page  # the only other match is shown now

    # A run shown already, one not visible, junk, or a full comparison: the link is unchanged
    # and the page says why.
    assert client.get("/compare/", {"runs": f"{a.pk},{b.pk}", "add": str(a.pk)})["Location"] == (
        f"/compare/?runs={a.pk},{b.pk}"
    )
    page = client.get("/compare/", {"runs": str(a.pk), "add": "x"}).content.decode()
    assert "add: &#x27;x&#x27; is not a run id" in page
    full = ",".join(str(make_run(name=f"f{i}").pk) for i in range(MAX_RUNS))
    response = client.get("/compare/", {"runs": full, "add": str(c.pk)})
    assert response.status_code == 200 and f"at most {MAX_RUNS} runs" in response.content.decode()


def test_a_bad_search_without_javascript_names_the_fix(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    a = make_run(name="x")
    response = client_for(viewer).get("/compare/", {"runs": str(a.pk), "q": "status:sleeping"})
    assert response.status_code == 200
    assert "unknown status &#x27;sleeping&#x27;: use one of" in response.content.decode()
