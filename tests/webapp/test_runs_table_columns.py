"""The runs table's chosen columns (issue 18): metric summaries kept at ingest (rewinds included),
columns of config keys and metric summaries sorted and filtered by the database, grouping,
the view kept per user and in the URL, and untrusted column specs refused with a message."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.apps import apps
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from tests.webapp.event_builders import metrics, status
from tests.webapp.test_run_attempts import checkpoint, ship
from webapp.analysis import table
from webapp.analysis.models import MetricSummary, TableView
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
from webapp.runs.services import resume_run
from webapp.teams.models import Project

HTMX = {"HTTP_HX_REQUEST": "true"}


def _summary(run: Run, name: str) -> tuple[float, int, float, float, int]:
    s = MetricSummary.objects.get(run=run, name=name)
    return (s.last, s.last_step, s.min, s.max, s.count)


def _row_ids(html: str) -> list[int]:
    return [int(m) for m in re.findall(r'<tr id="run-row-\d+" data-run-id="(\d+)"', html)]


def _page(client: Client, project: Project, query: str, **extra: Any) -> Any:
    return client.get(f"/projects/{project.pk}/?{query}", **extra)


# --- summaries at ingest ---------------------------------------------------------------------


def test_summaries_follow_each_ingested_batch(run: Run) -> None:
    store_events(
        run.pk, [status(1, "starting"), metrics(2, 1, reward=0.5, loss=3.0), metrics(3, 2, reward=0.2)]
    )
    assert _summary(run, "reward") == (0.2, 2, 0.2, 0.5, 2)
    assert _summary(run, "loss") == (3.0, 1, 3.0, 3.0, 1)
    # A later batch folds in: min, max and count combine; the last value moves with the step.
    store_events(run.pk, [metrics(4, 3, reward=0.9), metrics(5, 4, reward=-1.0, loss=1.0)])
    assert _summary(run, "reward") == (-1.0, 4, -1.0, 0.9, 4)
    assert _summary(run, "loss") == (1.0, 4, 1.0, 3.0, 2)
    # A batch sent again is skipped with the events: the summaries do not count it twice.
    store_events(run.pk, [metrics(4, 3, reward=0.9), metrics(5, 4, reward=-1.0, loss=1.0)])
    assert _summary(run, "reward")[4] == 4
    # A metric logged twice at one step is stored once, with its first value: so is its summary.
    store_events(run.pk, [metrics(6, 5, reward=0.3), metrics(7, 5, reward=7.0)])
    assert _summary(run, "reward") == (0.3, 5, -1.0, 0.9, 5)
    # ... also when the repeat comes in a later batch, beside a new step.
    store_events(run.pk, [metrics(8, 5, reward=9.0), metrics(9, 6, reward=0.4)])
    assert _summary(run, "reward") == (0.4, 6, -1.0, 0.9, 6)


def _attempt(
    first_seq: int, steps: range, value: Callable[[int], float], ckpt: tuple[int, ...] = ()
) -> list[Any]:
    seq, events = first_seq + 2, [status(first_seq, "starting"), status(first_seq + 1, "running")]
    for step in steps:
        events.append(metrics(seq, step, loss=value(step)))
        seq += 1
        if step in ckpt:
            events.append(checkpoint(seq, step))
            seq += 1
    events.append(status(seq, "cancelled", "cancelled"))
    return events


def test_a_rewind_recomputes_the_summaries_from_the_history_it_keeps(
    make_run: Callable[..., Run], valid_config: dict[str, Any], member: Any
) -> None:
    run = make_run(config=valid_config)
    first = _attempt(1, range(1, 7), lambda s: 10.0 * s, ckpt=(2,))  # 10 .. 60
    ship(run, first)
    assert _summary(run, "loss") == (60.0, 6, 10.0, 60.0, 6)
    # Resumed from step 2: steps 3.. of attempt 1 are superseded, attempt 2 logs 3 and 4 lower.
    resume_run(run, member, run.checkpoints.get(step=2))
    ship(run, _attempt(first[-1]["seq"] + 1, range(3, 5), lambda s: 1.0 * s))
    # The history is 10, 20 (attempt 1) then 3, 4: max 20, not the superseded 60; last 4 at step 4.
    assert _summary(run, "loss") == (4.0, 4, 3.0, 20.0, 4)


def test_the_migration_backfills_summaries_from_stored_points(run: Run) -> None:
    store_events(run.pk, [metrics(1, 1, reward=0.5), metrics(2, 2, reward=0.1), metrics(3, 3, reward=0.3)])
    expected = _summary(run, "reward")
    MetricSummary.objects.all().delete()
    backfill = __import__("webapp.analysis.migrations.0001_initial", fromlist=["backfill"]).backfill
    backfill(apps, None)
    assert _summary(run, "reward") == expected == (0.3, 3, 0.1, 0.5, 3)


# --- a project of runs with configs and metrics -------------------------------------------------


@pytest.fixture
def sweep(make_run: Callable[..., Run]) -> list[Run]:
    """Six runs: clip 0.2 or 0.28, rollout.n 4 or 8, reward last = 0.1 * i, loss on four of them."""
    runs = []
    for i in range(6):
        config = {
            "algorithm": {"name": "grpo" if i < 3 else "dapo", "clip_ratio_high": 0.2 if i % 2 else 0.28},
            "rollout": {"n": 4 if i < 4 else 8},
        }
        run = make_run(name=f"run-{i}", config=config)
        values: dict[str, float] = {"reward/mean": 0.1 * i}
        if i < 4:
            values["loss"] = 5.0 - i
        store_events(run.pk, [metrics(1, 1, **{"reward/mean": 1.0 - 0.1 * i}), metrics(2, 2, **values)])
        runs.append(run)
    return runs


@pytest.fixture
def member_client(client_for: Callable[..., Client], member: Any) -> Client:
    return client_for(member)


def _names(html: str, runs: list[Run]) -> list[str]:
    by_id = {r.pk: r.name for r in runs}
    return [by_id[i] for i in _row_ids(html)]


def test_columns_sort_by_a_metric_summary_and_by_a_config_value(
    member_client: Client, project: Project, sweep: list[Run]
) -> None:
    cols = "col=config:rollout.n&col=last:reward/mean&col=max:reward/mean&col=min:loss"
    html = _page(member_client, project, f"{cols}&sort=-last:reward/mean", **HTMX).content.decode()
    assert _names(html, sweep) == [f"run-{i}" for i in (5, 4, 3, 2, 1, 0)]
    assert 'data-spec="config:rollout.n"' in html and 'data-spec="min:loss"' in html
    # max of reward: run-0 had 1.0 at step 1 and 0.0 at step 2.
    html = _page(member_client, project, f"{cols}&sort=max:reward/mean", **HTMX).content.decode()
    assert _names(html, sweep) == [f"run-{i}" for i in (5, 4, 3, 2, 1, 0)]
    # Runs without the metric come last whatever the direction.
    for sort in ("min:loss", "-min:loss"):
        names = _names(_page(member_client, project, f"{cols}&sort={sort}", **HTMX).content.decode(), sweep)
        assert set(names[-2:]) == {"run-4", "run-5"}
    names = _names(_page(member_client, project, f"{cols}&sort=min:loss", **HTMX).content.decode(), sweep)
    assert names[:4] == ["run-3", "run-2", "run-1", "run-0"]
    # A config value sorts as a number: 4 before 8; ties by newest run first.
    names = _names(
        _page(member_client, project, f"{cols}&sort=config:rollout.n", **HTMX).content.decode(), sweep
    )
    assert names == ["run-3", "run-2", "run-1", "run-0", "run-5", "run-4"]


def test_filters_compare_metrics_as_numbers_and_config_values_by_equality_or_text(
    member_client: Client, project: Project, sweep: list[Run]
) -> None:
    def names(query: str) -> set[str]:
        response = _page(member_client, project, query, **HTMX)
        assert response.status_code == 200, response.content.decode()
        return set(_names(response.content.decode(), sweep))

    assert names("where=last:reward/mean|gt|0.25") == {"run-3", "run-4", "run-5"}
    assert names("where=last:reward/mean|le|0.2") == {"run-0", "run-1", "run-2"}
    assert names("where=min:loss|ge|3") == {"run-0", "run-1", "run-2"}
    assert names("where=config:algorithm.clip_ratio_high|eq|0.28") == {"run-0", "run-2", "run-4"}
    assert names("where=config:rollout.n|eq|8") == {"run-4", "run-5"}
    assert names("where=config:algorithm.name|eq|dapo") == {"run-3", "run-4", "run-5"}
    assert names("where=config:algorithm.name|contains|RP") == {"run-0", "run-1", "run-2"}
    assert names("where=config:algorithm.missing_key|missing|") == {f"run-{i}" for i in range(6)}
    # Filters combine, and a filter's column is shown.
    both = "where=config:rollout.n|eq|4&where=last:reward/mean|gt|0.15"
    assert names(both) == {"run-2", "run-3"}
    assert 'data-spec="last:reward/mean"' in _page(member_client, project, both, **HTMX).content.decode()


def test_grouping_aggregates_the_chosen_metrics_per_config_value(
    member_client: Client, project: Project, sweep: list[Run]
) -> None:
    runs = Run.objects.filter(project=project)
    state, _ = table.state_from_query(_query("group=rollout.n&col=last:reward/mean&col=min:loss"), None)
    rows = list(table.grouped(table.annotate(runs, state), state, "-last:reward/mean"))
    assert [(table.group_value(r, 0), r["n"]) for r in rows] == [(8, 2), (4, 4)]
    assert rows[0]["col0_mean"] == pytest.approx(0.45) and rows[1]["col0_mean"] == pytest.approx(0.15)
    assert (rows[1]["col0_min"], rows[1]["col0_max"]) == (0.0, pytest.approx(0.3))
    assert rows[0]["col1_mean"] is None and rows[1]["col1_mean"] == pytest.approx(3.5)

    html = _page(
        member_client, project, "group=rollout.n&group=algorithm.name&col=last:reward/mean"
    ).content.decode()
    assert html.count('class="group-row"') == 3  # (4, grpo) x3, (4, dapo) x1, (8, dapo) x2
    assert "0.4500" not in html and ">0.45 <" in html  # mean of run-4, run-5: 0.4 and 0.5
    # Expanding a group lists its runs (the htmx fragment), with the group's filters.
    expand = re.search(r'hx-get="([^"]+fragment=group[^"]*)"', html)
    assert expand is not None
    fragment = member_client.get(expand.group(1).replace("&amp;", "&"), **HTMX).content.decode()
    listed = re.findall(r'<li data-run-id="(\d+)"', fragment)
    assert len(listed) in (1, 2, 3) and "<table" not in fragment


def _query(text: str) -> Any:
    from django.http import QueryDict

    return QueryDict(text)


# --- the view kept per user and in the URL ---------------------------------------------------------


def test_the_chosen_columns_are_kept_per_user_and_written_into_the_address(
    client_for: Callable[..., Client], member: Any, viewer: Any, project: Project, sweep: list[Run]
) -> None:
    bob = client_for(member)
    # Adding a column is a plain GET form: the page saves it and redirects to the view's address.
    response = _page(bob, project, "add_kind=last&add_key=reward/mean")
    assert response.status_code == 302
    assert parse_qs(urlsplit(response["Location"]).query) == {"col": ["last:reward/mean"]}
    response = _page(
        bob, project, "col=last:reward/mean&add_kind=config&add_key=rollout.n&add_group=rollout.n"
    )
    target = parse_qs(urlsplit(response["Location"]).query)
    assert target == {"col": ["last:reward/mean", "config:rollout.n"], "group": ["rollout.n"]}
    saved = TableView.objects.get(user=member, project=project)
    assert (saved.columns, saved.group_by) == (["last:reward/mean", "config:rollout.n"], ["rollout.n"])
    # The bare address brings the saved view back, in the address (a copied link reproduces it).
    response = _page(bob, project, "status=queued")
    assert response.status_code == 302
    assert parse_qs(urlsplit(response["Location"]).query) == {
        "status": ["queued"], "col": ["last:reward/mean", "config:rollout.n"], "group": ["rollout.n"]
    }  # fmt: skip
    # Another user has their own (none), and a URL with columns shows them without a saved view.
    carol = client_for(viewer)
    assert _page(carol, project, "").status_code == 200
    html = _page(carol, project, "col=min:loss").content.decode()
    assert 'data-spec="min:loss"' in html and 'data-spec="last:reward/mean"' not in html
    assert TableView.objects.get(user=viewer, project=project).columns == ["min:loss"]
    # Dropping columns and the group: back to the fixed columns, saved as such.
    response = _page(
        bob, project, "col=last:reward/mean&col=config:rollout.n&group=rollout.n&drop_group=rollout.n"
    )
    response = _page(bob, project, "col=last:reward/mean&drop=last:reward/mean")
    assert response.status_code == 302 and "col=" not in response["Location"]
    assert TableView.objects.get(user=member, project=project).columns == []
    assert _page(bob, project, "").status_code == 200


def test_a_saved_column_no_run_has_any_more_is_left_out_with_a_notice(
    member_client: Client, member: Any, project: Project, sweep: list[Run]
) -> None:
    TableView.objects.create(user=member, project=project, columns=["last:gone/metric", "config:rollout.n"])
    response = _page(member_client, project, "", **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and "left out" in html and "gone/metric" in html
    assert 'data-spec="config:rollout.n"' in html


# --- untrusted column specs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("col=sql:1", "is not a column"),
        ("col=config:a__b", "'__'"),
        ("col=config:algorithm.name');DROP TABLE runs_run;--", "is not a config key path"),
        ("col=config:" + ".".join(["a"] * 9), "is not a config key path"),
        ("col=config:" + "x" * 70, "is not a config key path"),
        ("col=last:", "is not a metric name"),
        ("col=last:" + "m" * 201, "is not a metric name"),
        ("col=max:a|b", "is not a metric name"),
        ("col=config:nope.nothing", "no run here has the config key 'nope.nothing'"),
        ("col=last:never/logged", "no run here has logged the metric 'never/logged'"),
        ("group=rollout.n&group=a&group=b&group=c", "at most 3"),
        ("group=rollout..n", "is not a config key path"),
        ("where=last:reward/mean|gt|abc", "compares with a number"),
        ("where=last:reward/mean|gt|nan", "compares with a number"),
        ("where=last:reward/mean|like|1", "does not compare a metric"),
        ("where=config:rollout.n|gt|1", "does not apply to a config value"),
        ("where=config:rollout.n", "is not a filter"),
        ("sort=last:reward/mean", "is not a column of this table"),
        ("sort=" + "s" * 300, "sort"),
        ("add_kind=bogus&add_key=x", "is not a column"),
        ("col=" + "&col=".join(f"config:k{i}" for i in range(17)), "at most 16"),
    ],
)
def test_untrusted_column_specs_are_refused_with_a_message(
    member_client: Client, project: Project, sweep: list[Run], query: str, words: str
) -> None:
    for extra in ({}, HTMX):
        response = _page(member_client, project, query, **extra)
        assert response.status_code == 400, (query, response.status_code)
        assert words in response.content.decode().replace("&#x27;", "'"), query
    assert Run.objects.filter(project=project).count() == 6  # still there
    assert not TableView.objects.exists()


# --- queries constant in the page size ----------------------------------------------------------------


def test_the_page_makes_as_many_queries_for_50_runs_as_for_10(
    member_client: Client, make_run: Callable[..., Run], project: Project
) -> None:
    cols = "&".join(
        f"col={c}"
        for c in (
            "config:algorithm.name",
            "config:algorithm.clip_ratio_high",
            "config:rollout.n",
            "last:reward/mean",
            "max:reward/mean",
            "min:loss",
            "last:loss",
        )
    )
    query = f"{cols}&sort=-last:reward/mean&where=last:reward/mean|ge|0"

    def add_runs(n: int, start: int) -> None:
        for i in range(start, start + n):
            config = {"algorithm": {"name": "grpo", "clip_ratio_high": 0.2}, "rollout": {"n": i}}
            run = make_run(name=f"r{i}", config=config)
            store_events(run.pk, [metrics(1, 1, **{"reward/mean": 0.01 * i, "loss": 1.0})])

    def count(q: str) -> int:
        with CaptureQueriesContext(connection) as ctx:
            response = _page(member_client, project, q, **HTMX)
            assert response.status_code == 200
        return len(ctx.captured_queries)

    add_runs(10, 0)
    assert len(_row_ids(_page(member_client, project, query, **HTMX).content.decode())) == 10
    few, few_grouped = count(query), count(f"{query}&group=algorithm.name")
    add_runs(40, 10)
    assert len(_row_ids(_page(member_client, project, query, **HTMX).content.decode())) == 50
    assert count(query) == few
    assert count(f"{query}&group=algorithm.name") == few_grouped


def test_the_full_page_lists_the_project_keys_and_metrics_in_its_pickers(
    member_client: Client, project: Project, sweep: list[Run]
) -> None:
    html = _page(member_client, project, "col=").content.decode()
    config_keys = re.search(r'<datalist id="config-keys">(.*?)</datalist>', html).group(1)  # type: ignore[union-attr]
    metric_names = re.search(r'<datalist id="metric-names">(.*?)</datalist>', html).group(1)  # type: ignore[union-attr]
    assert re.findall(r'value="([^"]+)"', config_keys) == [
        "algorithm.clip_ratio_high",
        "algorithm.name",
        "rollout.n",
    ]
    assert re.findall(r'value="([^"]+)"', metric_names) == ["loss", "reward/mean"]
    assert RunStatus.QUEUED  # the runs are queued ones: the table lists them all


def test_a_filtered_page_past_the_end_shows_the_last_page_with_its_total(
    member_client: Client, project: Project, sweep: list[Run]
) -> None:
    html = _page(member_client, project, "where=last:reward/mean|ge|0.2&page=7", **HTMX).content.decode()
    assert sorted(_names(html, sweep)) == ["run-2", "run-3", "run-4", "run-5"]
    assert "4 runs match" in html
    html = _page(member_client, project, "where=last:reward/mean|ge|9&page=3", **HTMX).content.decode()
    assert _row_ids(html) == [] and "No runs match these filters" in html
