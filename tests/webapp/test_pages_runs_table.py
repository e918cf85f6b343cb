"""A project's runs table: permissions, filters, sorting, paging, sparklines, bulk cancel."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from webapp.analysis import rollups
from webapp.analysis.models import MetricRollup
from webapp.pages.teams import sparkline
from webapp.pages.teams.views import format_duration
from webapp.runs.choices import RunStatus
from webapp.runs.models import MetricPoint, Run
from webapp.teams.models import Project

HTMX = {"HTTP_HX_REQUEST": "true"}


def _url(project: Project, query: str = "") -> str:
    return f"/projects/{project.pk}/{query}"


def _row_ids(html: str) -> list[int]:
    return [int(m) for m in re.findall(r'<tr id="run-row-\d+" data-run-id="(\d+)"', html)]


def _row(html: str, run: Run) -> str:
    start = html.index(f'id="run-row-{run.pk}"')
    return html[start : html.index("</tr>", start)]


def _points(run: Run, name: str, values: list[float], start: int = 1) -> None:
    t0 = timezone.now() - timedelta(hours=1)
    MetricPoint.objects.bulk_create(
        MetricPoint(
            run=run, name=name, step=start + i, value=v, time=t0 + timedelta(seconds=i), seq=start + i
        )
        for i, v in enumerate(values)
    )


@pytest.fixture
def many_runs(project: Project, member: Any) -> list[Run]:
    """120 runs created one minute apart (run-000 oldest), statuses cycling."""
    statuses = [RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.SUCCEEDED, RunStatus.FAILED]
    runs = Run.objects.bulk_create(
        Run(project=project, created_by=member, name=f"run-{i:03d}", status=statuses[i % 4], last_step=i)
        for i in range(120)
    )
    t0 = timezone.now() - timedelta(days=1)
    for i, run in enumerate(runs):
        Run.objects.filter(pk=run.pk).update(created_at=t0 + timedelta(minutes=i))
    return list(Run.objects.filter(project=project).order_by("name"))


# --- who sees what -------------------------------------------------------------------------


def test_the_table_needs_a_sign_in_and_hides_other_teams(
    client: Client, client_for: Callable[..., Client], outsider: Any, project: Project, run: Run
) -> None:
    response = client.get(_url(project))
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert client_for(outsider).get(_url(project)).status_code == 404
    assert client_for(outsider).get("/projects/999999/").status_code == 404
    assert client_for(outsider).post(_url(project, "cancel/"), {"runs": [run.pk]}).status_code == 404
    assert client_for(outsider).post(_url(project, "compare/"), {"runs": [run.pk]}).status_code == 404
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED


def test_a_viewer_sees_the_runs_but_cannot_cancel_or_launch(
    client_for: Callable[..., Client], viewer: Any, project: Project, run: Run
) -> None:
    client = client_for(viewer)
    page = client.get(_url(project)).content.decode()
    assert _row_ids(page) == [run.pk] and f'href="/runs/{run.pk}/"' in page
    assert 'id="cancel-selected"' not in page and 'id="new-run"' not in page
    assert 'id="compare-selected"' in page
    assert "a team member can launch one" not in page  # there is a run
    response = client.post(_url(project, "cancel/"), {"runs": [run.pk]}, **HTMX)
    assert response.status_code == 403
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED and run.cancel_requested_at is None


def test_a_member_gets_the_cancel_button_and_the_new_run_link(
    client_for: Callable[..., Client], member: Any, project: Project, run: Run
) -> None:
    page = client_for(member).get(_url(project)).content.decode()
    assert 'id="cancel-selected"' in page and f'href="/projects/{project.pk}/new/"' in page
    assert f'data-socket="/ws/projects/{project.pk}/"' in page
    assert "/static/tributary/runs_table.js" in page and 'id="run-status-meta"' in page


# --- columns -------------------------------------------------------------------------------


def test_a_row_shows_status_creator_tags_times_and_key_metrics(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    started = timezone.now() - timedelta(minutes=5, seconds=3)
    run = make_run(
        name="dapo-lr3e-6",
        status=RunStatus.RUNNING,
        started_at=started,
        tags=["baseline", "math"],
        last_step=42,
        summary={"reward/mean": 0.61234, "train/accuracy": 0.5, "actor/entropy": 1.25, "other": 3},
    )
    done = make_run(
        name="finished",
        status=RunStatus.SUCCEEDED,
        started_at=started,
        finished_at=started + timedelta(hours=2, minutes=3),
        summary={"eval/accuracy": 0.75, "train/accuracy": 0.5},
    )
    page = client_for(viewer).get(_url(run.project)).content.decode()
    row = _row(page, run)
    assert 'class="badge primary" data-role="status-badge">Running<' in row
    assert "bob-member" in row and ">baseline</a>" in row and ">math</a>" in row
    assert f'<time datetime="{started.isoformat()}' in row
    assert re.search(r'data-role="duration">5m 0[3-9]s<', row)
    assert f'data-started-at="{started.timestamp()}"' in row
    assert 'data-role="last-step">42<' in row
    assert "0.612" in row and "0.500" in row and "1.250" in row
    done_row = _row(page, done)
    assert 'data-role="duration">2h 03m<' in done_row and "0.750" in done_row  # eval before train
    assert 'class="badge success"' in done_row


# The row as ``_runs_results.html`` wrote it with template tags, before ``rows.row_html`` built it
# in Python (for the page's time): the two must agree byte for byte, escaping included.
TEMPLATE_ROW = """<tr id="run-row-{{ row.run.pk }}" data-run-id="{{ row.run.pk }}" data-status="{{ row.status }}" data-started-at="{{ row.started_ts }}" data-finished-at="{{ row.finished_ts }}">
                <td class="select-col"><input type="checkbox" name="runs" value="{{ row.run.pk }}" form="bulk-form" class="run-select" aria-label="Select {{ row.run.name }}"></td>
                <td class="run-name"><a href="{{ row.run.get_absolute_url }}">{{ row.run.name }}</a>{% if row.run.is_external %} <span class="badge info run-origin" title="Trained by the user's own script, which reports here">external</span>{% endif %}</td>
                <td class="run-status"><span class="badge {{ row.status.badge }}" data-role="status-badge"{% if row.message %} title="{{ row.message }}"{% endif %}>{{ row.status.label }}</span>{% if row.run.cancel_requested_at and row.active %} <span class="muted cancel-note">cancelling…</span>{% endif %}<span class="badge danger alert-count" data-role="alert-count" data-count="{{ row.alerts }}" title="Health alerts: see the run page"{% if not row.alerts %} hidden{% endif %}>{{ row.alerts }} alert{{ row.alerts|pluralize }}</span></td>
                <td class="hide-narrow">{% if row.run.created_by %}{{ row.run.created_by.get_username }}{% else %}<span class="muted">—</span>{% endif %}</td>
                <td class="hide-narrow run-tags">{% for tag in row.run.tags %}<a class="tag" href="{{ base }}?tag={{ tag|urlencode:"" }}">{{ tag }}</a>{% empty %}<span class="muted">—</span>{% endfor %}</td>
                <td class="hide-narrow run-started">{% if row.run.started_at %}<time datetime="{{ row.run.started_at|date:'c' }}">{{ row.run.started_at|date:"Y-m-d H:i" }} UTC</time>{% else %}<span class="muted">not yet</span>{% endif %}</td>
                <td class="run-duration" data-role="duration">{{ row.duration|default:"—" }}</td>
                <td class="num run-step" data-role="last-step">{{ row.run.last_step }}</td>
                <td class="run-reward">{% if row.spark %}<span class="spark">{{ row.spark }}</span>{% endif %}{% if row.reward %} <span class="num" title="{{ row.reward.0 }}">{{ row.reward.1|floatformat:3 }}</span>{% elif not row.spark %}<span class="muted">—</span>{% endif %}</td>
                <td class="num run-accuracy">{% if row.accuracy %}<span title="{{ row.accuracy.0 }}">{{ row.accuracy.1|floatformat:3 }}</span>{% else %}<span class="muted">—</span>{% endif %}</td>
                <td class="num hide-narrow run-entropy">{% if row.entropy %}{{ row.entropy.1|floatformat:3 }}{% else %}<span class="muted">—</span>{% endif %}</td>
                {{ row.cells_html }}
              </tr>"""


def test_a_row_built_in_python_is_the_templates_row(make_run: Callable[..., Run], project: Project) -> None:
    from django.template import engines

    from webapp.alerts.models import Alert
    from webapp.analysis.table import Column, TableState
    from webapp.pages.teams.views import run_rows
    from webapp.runs.choices import RunOrigin

    now = timezone.now()
    started = now - timedelta(minutes=5, seconds=3)
    runs = [
        make_run(name="plain"),
        make_run(
            name="<b>'x' & \"y\"</b>",
            status=RunStatus.RUNNING,
            status_message="<img src=x> stopping & more",
            started_at=started,
            cancel_requested_at=now,
            tags=["a b", "<script>", "ü/?&=", 7],
            last_step=12345,
            summary={"reward/mean": 2.675, "eval/accuracy": -0.0001, "actor/entropy": 1e-9},
            origin=RunOrigin.EXTERNAL,
            config={"x": "<i>", "n": 0.1 + 0.2},
        ),
        make_run(
            name="done",
            status=RunStatus.SUCCEEDED,
            started_at=started,
            finished_at=started + timedelta(hours=2),
            summary={"train/accuracy": True, "reward/mean": 1e300},
            tags=[],
        ),
    ]
    Run.objects.filter(pk=runs[2].pk).update(created_by=None)  # its creator's account removed
    _points(runs[0], "reward/mean", [0.1, 0.5, 0.2])
    for i, n in ((1, 1), (2, 2)):
        for j in range(n):
            Alert.objects.create(run=runs[i], rule="r", step=j, seq=j, message="m")
    state = TableState([Column("config", "x"), Column("config", "n"), Column("last", "reward/mean")])
    rows = run_rows(list(Run.objects.filter(project=project)), state, project, [], base="/projects/1/")
    template = engines["django"].from_string(TEMPLATE_ROW)
    assert len(rows) == 3 and any(row["spark"] for row in rows)
    for row in rows:
        assert row["html"] == template.render({"row": row, "base": "/projects/1/"})


def test_durations_read_well() -> None:
    assert [format_duration(s) for s in (None, -3, 0, 59, 61, 3599, 3600, 90061)] == [
        "", "0s", "0s", "59s", "1m 01s", "59m 59s", "1h 00m", "25h 01m"
    ]  # fmt: skip


def test_user_text_is_escaped(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    run = make_run(name="<script>alert('name')</script>", tags=["<script>alert('tag')</script>", '"><b>x</b>'],
                   status_message="<img src=x onerror=alert(1)>")  # fmt: skip
    page = client_for(viewer).get(_url(run.project)).content.decode()
    assert "<script>alert" not in page and "<b>x</b>" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(&#x27;name&#x27;)&lt;/script&gt;" in page
    assert "&lt;script&gt;alert(&#x27;tag&#x27;)&lt;/script&gt;" in page
    # A tag is also a filter link: its text is URL-encoded in the address.
    assert "?tag=%3Cscript%3Ealert%28%27tag%27%29%3C%2Fscript%3E" in page


# --- sparklines ----------------------------------------------------------------------------


def test_a_sparkline_is_drawn_from_about_forty_points(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run]
) -> None:
    long = make_run(name="long", summary={"reward/mean": 0.9})
    short = make_run(name="short")
    bare = make_run(name="bare")
    _points(long, "reward/mean", [i / 1000 for i in range(1000)])
    _points(long, "actor/entropy", [1.0] * 10)
    _points(short, "reward/mean", [0.1, 0.3, 0.2])
    page = client_for(viewer).get(_url(long.project)).content.decode()
    svgs = dict(re.findall(r'id="run-row-(\d+)".*?(?:data-points="(\d+)"|</tr>)', page, re.S))
    assert 30 <= int(svgs[str(long.pk)]) <= sparkline.POINTS
    assert svgs[str(short.pk)] == "3"
    assert svgs[str(bare.pk)] == ""
    assert page.count('<svg class="sparkline"') == 2 and 'aria-label="reward/mean trend' in page


def test_sparkline_series_are_bucket_means_in_step_order(make_run: Callable[..., Run]) -> None:
    a, b, c = make_run(name="a"), make_run(name="b"), make_run(name="c")
    _points(a, "reward/mean", [float(i) for i in range(400)], start=0)  # steps 0..399
    _points(b, "reward/mean", [5.0, 6.0, 7.0], start=10)
    series = sparkline.series_for_runs([a.pk, b.pk, c.pk], "reward/mean", points=40)
    assert set(series) == {a.pk, b.pk}
    assert [s for s, _ in series[a.pk]] == list(range(0, 400, 10))
    assert [v for _, v in series[a.pk]][:2] == [4.5, 14.5]  # mean of steps 0..9, 10..19
    assert series[b.pk] == [(10, 5.0), (11, 6.0), (12, 7.0)]
    assert sparkline.series_for_runs([], "reward/mean") == {}
    flat = str(sparkline.svg([(1, 2.0), (2, 2.0)], 'x"<'))
    assert 'aria-label="x&quot;&lt;"' in flat and "NaN" not in flat


def test_long_sparklines_are_combined_from_the_blocks_kept_at_ingest(make_run: Callable[..., Run]) -> None:
    """A series of 10,000 steps is read from its rollup blocks (``webapp.analysis.rollups``): 40
    buckets ``step // 256`` (the smallest power of two giving at most 40), each the mean of its
    points. A short series, and a long one without blocks, are read from their points; a huge
    value averages without overflow (PostgreSQL's AVG overflows from 1e154 on). Three queries."""
    rolled, unrolled, short = make_run(name="rolled"), make_run(name="unrolled"), make_run(name="short")
    values = [((i * 37) % 101) / 7 for i in range(10_000)]
    for run in (rolled, unrolled):
        _points(run, "reward/mean", values)  # steps 1..10,000
    _points(short, "reward/mean", [1e300, 3e300, 2.0])
    for run in (rolled, short):
        rollups.rebuild(run.pk)
    assert MetricRollup.objects.filter(run=rolled).exists()
    with CaptureQueriesContext(connection) as ctx:
        series = sparkline.series_for_runs([rolled.pk, unrolled.pk, short.pk], "reward/mean", points=40)
    assert len(ctx.captured_queries) == 3
    blocks_sql = [q["sql"] for q in ctx.captured_queries if MetricRollup._meta.db_table in q["sql"]]
    assert len(blocks_sql) == 2 and all(MetricPoint._meta.db_table not in sql for sql in blocks_sql)
    buckets: dict[int, list[tuple[int, float]]] = {}
    for step, value in enumerate(values, start=1):
        buckets.setdefault(step // 256, []).append((step, value))
    want = [(b[0][0], sum(v for _, v in b) / len(b)) for b in buckets.values()]
    got = series[rolled.pk]
    assert len(got) == 40 and [s for s, _ in got] == [s for s, _ in want]
    # Sums in another order than Python's: equal to rounding (13 digits over 256 values).
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)
    assert len(series[unrolled.pk]) == 40  # from its points: 40 buckets over its own range
    assert series[short.pk] == [(1, 1e300), (2, 3e300), (3, 2.0)]


def test_sparklines_cost_the_same_queries_for_few_or_many_runs(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run], project: Project
) -> None:
    client = client_for(viewer)

    def queries_for_page() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(_url(project)).status_code == 200
        return len(ctx.captured_queries)

    for i in range(2):
        _points(make_run(name=f"r{i}"), "reward/mean", [0.1 * j for j in range(60)])
    few = queries_for_page()
    for i in range(2, 12):
        _points(make_run(name=f"r{i}"), "reward/mean", [0.1 * j for j in range(60)])
    assert queries_for_page() == few


# --- filters, sorting, paging ----------------------------------------------------------------


def test_fifty_runs_a_page_newest_first(
    client_for: Callable[..., Client], viewer: Any, many_runs: list[Run]
) -> None:
    client = client_for(viewer)
    by_name = {r.name: r.pk for r in many_runs}
    first = client.get(_url(many_runs[0].project)).content.decode()
    ids = _row_ids(first)
    assert len(ids) == 50 and ids[0] == by_name["run-119"] and ids[-1] == by_name["run-070"]
    assert "120 runs" in first and "page 1 of 3" in first
    assert 'id="page-prev"' not in first and 'href="/projects/' in first and "?page=2" in first
    last = client.get(_url(many_runs[0].project, "?page=3")).content.decode()
    assert len(_row_ids(last)) == 20 and 'id="page-next"' not in last and 'id="page-prev"' in last
    # Out of range and nonsense pages: the last page, and a clear error.
    assert _row_ids(client.get(_url(many_runs[0].project, "?page=99")).content.decode()) == _row_ids(last)
    bad = client.get(_url(many_runs[0].project, "?page=abc"))
    assert bad.status_code == 400 and "page: Enter a whole number." in bad.content.decode()


def test_filter_by_statuses_tag_and_text(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run], project: Project
) -> None:
    a = make_run(name="grpo-a", status=RunStatus.RUNNING, tags=["math", "v2"])
    b = make_run(name="grpo-b", status=RunStatus.FAILED, tags=["math"])
    c = make_run(name="ppo-c", status=RunStatus.SUCCEEDED, tags=["code"], notes="tried GRPO first")
    client = client_for(viewer)

    def ids(query: str) -> set[int]:
        response = client.get(_url(project, query))
        assert response.status_code == 200
        return set(_row_ids(response.content.decode()))

    assert ids("") == {a.pk, b.pk, c.pk}
    assert ids("?status=running&status=failed") == {a.pk, b.pk}
    assert ids("?tag=math") == {a.pk, b.pk}
    assert ids("?tag=v2") == {a.pk}
    assert ids("?q=GRPO") == {a.pk, b.pk, c.pk}  # names and notes, case-insensitive
    assert ids("?q=ppo") == {c.pk}
    assert ids("?tag=math&status=failed&q=grpo") == {b.pk}
    page = client.get(_url(project, "?status=running&tag=math")).content.decode()
    assert 'id="filter-status-running" checked' in page and 'id="filter-status-failed">' in page
    assert 'id="filter-tag" value="math"' in page and "1 run matches" in page
    empty = client.get(_url(project, "?tag=nothing")).content.decode()
    assert "No runs match these filters" in empty and "No runs yet" not in empty


def test_a_bad_filter_is_an_error_not_a_crash(
    client_for: Callable[..., Client], viewer: Any, project: Project, run: Run
) -> None:
    client = client_for(viewer)
    for query in ("?status=exploded", "?sort=drop_table", f"?q={'x' * 201}"):
        response = client.get(_url(project, query))
        assert response.status_code == 400, query
        page = response.content.decode()
        assert 'role="alert"' in page and "Fix the filter above" in page and _row_ids(page) == []
    # As an htmx partial too (runs_table.js swaps 400s into the table).
    partial = client.get(_url(project, "?status=exploded"), **HTMX)
    assert partial.status_code == 400 and "exploded" in partial.content.decode()
    assert "<html" not in partial.content.decode()


@pytest.mark.parametrize(
    ("sort", "expected"),
    [
        ("name", ["alpha", "beta", "gamma"]),
        ("-name", ["gamma", "beta", "alpha"]),
        ("last_step", ["beta", "gamma", "alpha"]),
        ("-last_step", ["alpha", "gamma", "beta"]),
        ("created_at", ["gamma", "alpha", "beta"]),
        ("-created_at", ["beta", "alpha", "gamma"]),
        ("status", ["gamma", "beta", "alpha"]),  # queued < running < succeeded, alphabetically
    ],
)
def test_sort_by_columns(
    client_for: Callable[..., Client],
    viewer: Any,
    make_run: Callable[..., Run],
    sort: str,
    expected: list[str],
) -> None:
    gamma = make_run(name="gamma", last_step=5, status=RunStatus.QUEUED)
    alpha = make_run(name="alpha", last_step=9, status=RunStatus.SUCCEEDED)
    beta = make_run(name="beta", last_step=1, status=RunStatus.RUNNING)
    names = {r.pk: r.name for r in (alpha, beta, gamma)}
    page = client_for(viewer).get(_url(alpha.project, f"?sort={sort}")).content.decode()
    assert [names[i] for i in _row_ids(page)] == expected


def test_sort_links_keep_filters_and_toggle(
    client_for: Callable[..., Client], viewer: Any, project: Project, run: Run
) -> None:
    run.tags = ["a"]
    run.save()
    page = client_for(viewer).get(_url(project, "?status=queued&tag=a&sort=name&page=1")).content.decode()
    assert (
        f'aria-sort="ascending"><a href="/projects/{project.pk}/?status=queued&amp;tag=a&amp;sort=-name"'
        in page
    )
    assert f'href="/projects/{project.pk}/?status=queued&amp;tag=a&amp;sort=-last_step"' in page
    assert 'name="sort" value="name"' in page  # the filter form keeps the sort


def test_htmx_gets_the_results_partial_with_its_own_address(
    client_for: Callable[..., Client], viewer: Any, project: Project, run: Run
) -> None:
    response = client_for(viewer).get(_url(project, "?status=queued&sort=name"), **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "HX-Request" in response["Vary"]
    assert html.lstrip().startswith('<div id="runs-results"') and "<html" not in html
    assert f'hx-get="/projects/{project.pk}/?status=queued&amp;sort=name"' in html
    assert 'hx-trigger="runs-changed from:body"' in html and _row_ids(html) == [run.pk]
    # A history restore asks for the whole page.
    full = client_for(viewer).get(
        _url(project), HTTP_HX_REQUEST="true", HTTP_HX_HISTORY_RESTORE_REQUEST="true"
    )
    assert "<html" in full.content.decode()


def test_empty_states(client_for: Callable[..., Client], member: Any, viewer: Any, project: Project) -> None:
    member_page = client_for(member).get(_url(project)).content.decode()
    assert (
        "No runs yet:" in member_page
        and f'<a href="/projects/{project.pk}/new/">launch one</a>' in member_page
    )
    assert 'id="runs-table"' not in member_page
    assert "a team member can launch one" in client_for(viewer).get(_url(project)).content.decode()


# --- bulk actions ------------------------------------------------------------------------------


def test_a_member_cancels_selected_runs_with_a_result_per_run(
    client_for: Callable[..., Client], member: Any, make_run: Callable[..., Run], other_team: Any
) -> None:
    queued = make_run(name="waiting")
    running = make_run(name="busy", status=RunStatus.RUNNING, started_at=timezone.now())
    done = make_run(name="done", status=RunStatus.SUCCEEDED)
    elsewhere = Run.objects.create(
        project=Project.objects.create(team=other_team, name="X", slug="x"), name="theirs"
    )
    response = client_for(member).post(
        _url(queued.project, "cancel/"),
        {"runs": [queued.pk, running.pk, done.pk, elsewhere.pk, "nope"]},
        **HTMX,
    )
    assert response.status_code == 200 and response["HX-Trigger"] == "runs-changed"
    html = response.content.decode()
    assert f'data-run-id="{queued.pk}"><strong>waiting</strong>: cancelled<' in html
    assert f'data-run-id="{running.pk}"><strong>busy</strong>: cancel requested' in html
    assert f'class="error" data-run-id="{done.pk}"><strong>done</strong>: already succeeded' in html
    assert f"#{elsewhere.pk}</strong>: not found in this project" in html and "theirs" not in html
    assert "nope</strong>: is not a run id" in html
    for r in (queued, running, done, elsewhere):
        r.refresh_from_db()
    assert queued.status == RunStatus.CANCELLED and queued.status_message == "cancelled by bob-member"
    assert running.status == RunStatus.RUNNING and running.cancel_requested_at is not None
    assert done.status == RunStatus.SUCCEEDED and elsewhere.status == RunStatus.QUEUED
    page = client_for(member).get(_url(queued.project)).content.decode()
    assert "cancelling…" in page


def test_cancel_without_javascript_redirects_back_with_messages(
    client_for: Callable[..., Client], admin: Any, run: Run
) -> None:
    client = client_for(admin)
    response = client.post(
        _url(run.project, "cancel/"), {"runs": [run.pk], "return_query": "status=queued&page=2"}
    )
    assert response.status_code == 302 and response["Location"] == _url(run.project, "?status=queued&page=2")
    page = client.get(_url(run.project)).content.decode()
    assert "grpo-baseline: cancelled" in page
    nothing = client.post(_url(run.project, "cancel/"), {}, follow=True)
    assert "Select the runs to cancel first." in nothing.content.decode()


def test_compare_without_javascript_goes_to_the_compare_page(
    client_for: Callable[..., Client], viewer: Any, make_run: Callable[..., Run], project: Project
) -> None:
    a, b = make_run(name="a"), make_run(name="b")
    client = client_for(viewer)
    response = client.post(_url(project, "compare/"), {"runs": [a.pk, b.pk]})
    assert response.status_code == 302 and response["Location"] == f"/compare/?runs={a.pk},{b.pk}"
    none = client.post(_url(project, "compare/"), {"return_query": "tag=x"})
    assert none.status_code == 302 and none["Location"] == _url(project, "?tag=x")
