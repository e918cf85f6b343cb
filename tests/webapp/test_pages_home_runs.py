"""The landing page's active and recent runs (issue 15): only the caller's teams' runs, which are
active and which recent, the fragment the page reads again on a status change, a fixed number of
queries whatever the number of runs, and empty states that say what to do."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from webapp.pages.home import MAX_SOCKETS, POLL_SECONDS, RECENT_LIMIT
from webapp.runs import selectors
from webapp.runs.choices import RunStatus
from webapp.runs.models import Run
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team


def _section(html: str, section: str) -> str:
    """The HTML of ``#active-runs`` or ``#recent-runs``."""
    start = html.index(f'id="{section}"')
    return html[start : html.index("</section>", start)]


def _ids(html: str, kind: str) -> list[int]:
    return [int(m) for m in re.findall(rf'<tr id="{kind}-run-(\d+)"', html)]


def _row(html: str, kind: str, run: Run) -> str:
    start = html.index(f'id="{kind}-run-{run.pk}"')
    return html[start : html.index("</tr>", start)]


def _finished(project: Project, name: str, status: RunStatus, minutes_ago: int, **fields: Any) -> Run:
    return Run.objects.create(
        project=project, name=name, status=status, config={},
        finished_at=timezone.now() - timedelta(minutes=minutes_ago), **fields,
    )  # fmt: skip


@pytest.fixture
def second_project(member: Any, other_team: Team) -> Project:
    """A project of a second team ``member`` belongs to (as a viewer)."""
    Membership.objects.create(user=member, team=other_team, role=Role.VIEWER)
    return Project.objects.create(team=other_team, name="MATH", slug="math")


@pytest.fixture
def stranger_project(django_user_model: Any) -> Project:
    """A project of a team ``member`` has no role in."""
    team = Team.objects.create(name="Elsewhere", slug="elsewhere")
    return Project.objects.create(team=team, name="Hidden", slug="hidden")


def test_active_and_recent_runs_of_every_team_of_the_caller_and_no_other(
    client_for: Callable[..., Client], member: Any, project: Project, second_project: Project, stranger_project: Project
) -> None:
    queued = Run.objects.create(project=project, name="waiting", config={"trainer": {"total_steps": 50}})
    running = Run.objects.create(
        project=second_project, name="training", status=RunStatus.RUNNING, last_step=12,
        config={"trainer": {"total_steps": 300}}, worker_host="gpu-box-1", started_at=timezone.now(),
    )  # fmt: skip
    starting = Run.objects.create(project=project, name="loading", status=RunStatus.STARTING, config={})
    done = _finished(project, "done", RunStatus.SUCCEEDED, 5, last_step=50, worker_host="gpu-box-2")
    broke = _finished(second_project, "broke", RunStatus.FAILED, 1)
    lost = _finished(project, "vanished", RunStatus.LOST, 30)
    Run.objects.create(project=stranger_project, name="secret-active", status=RunStatus.RUNNING, config={})
    _finished(stranger_project, "secret-done", RunStatus.SUCCEEDED, 0)

    html = client_for(member).get("/").content.decode()
    active, recent = _section(html, "active-runs"), _section(html, "recent-runs")
    assert _ids(active, "active") == [starting.pk, running.pk, queued.pk]  # newest first
    assert _ids(recent, "recent") == [broke.pk, done.pk, lost.pk]  # the last to finish first
    assert "secret" not in html and "Hidden" not in html and "Elsewhere" not in html

    row = _row(active, "active", running)
    assert f'href="/runs/{running.pk}/"' in row and ">training</a>" in row
    assert f'href="/projects/{second_project.pk}/"' in row and "MATH" in row and "Other lab" in row
    assert 'class="badge primary"' in row and ">Running<" in row
    assert 'data-step="12">12</span> / 300' in row and "gpu-box-1" in row and "<time datetime=" in row
    row = _row(active, "active", queued)
    assert ">Queued<" in row and ">0</span> / 50" in row and "not yet" in row
    # home.js moves the step live ([data-role=last-step]); no total in this one's config.
    assert re.search(r'run-step"><span data-role="last-step" data-step="0">0</span></td>', _row(active, "active", starting))
    row = _row(recent, "recent", done)
    assert ">Succeeded<" in row and "50" in row and "gpu-box-2" in row and "<time datetime=" in row
    assert ">Failed<" in _row(recent, "recent", broke) and ">Lost<" in _row(recent, "recent", lost)


def test_recent_runs_are_the_last_ones_to_finish(client_for: Callable[..., Client], member: Any, project: Project) -> None:
    runs = [_finished(project, f"run-{i:02d}", RunStatus.SUCCEEDED, minutes_ago=i) for i in range(RECENT_LIMIT + 3)]
    recent = _section(client_for(member).get("/").content.decode(), "recent-runs")
    assert _ids(recent, "recent") == [r.pk for r in runs[:RECENT_LIMIT]]


def test_the_fragment_is_the_two_lists_as_they_are_now(
    client: Client, client_for: Callable[..., Client], member: Any, outsider: Any, run: Run
) -> None:
    assert client.get("/home/runs/")["Location"].startswith("/login/")
    mine = client_for(member)
    response = mine.get("/home/runs/")
    fragment = response.content.decode()
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    assert fragment.lstrip().startswith("<div id=\"home-runs\"") and "<html" not in fragment
    assert _ids(fragment, "active") == [run.pk] and _ids(fragment, "recent") == []

    run.start(worker_host="box")
    run.transition(RunStatus.RUNNING)
    run.transition(RunStatus.SUCCEEDED)
    fragment = mine.get("/home/runs/").content.decode()
    assert _ids(fragment, "active") == [] and _ids(fragment, "recent") == [run.pk]
    assert "Nothing is queued or running" in fragment
    assert _ids(client_for(outsider).get("/home/runs/").content.decode(), "recent") == []
    assert mine.post("/home/runs/").status_code == 405


def test_the_page_and_the_fragment_make_the_same_queries_for_one_run_or_many(
    client_for: Callable[..., Client], member: Any, project: Project, second_project: Project
) -> None:
    mine = client_for(member)
    Run.objects.create(project=project, name="first", config={})

    def counts() -> list[int]:
        found = []
        for url in ("/", "/home/runs/"):
            with CaptureQueriesContext(connection) as queries:
                assert mine.get(url).status_code == 200
            found.append(len(queries))
        return found

    few = counts()
    for i in range(30):
        project_of = project if i % 2 else second_project
        if i % 3:
            Run.objects.create(project=project_of, name=f"active-{i}", status=RunStatus.RUNNING, config={})
        else:
            _finished(project_of, f"done-{i}", RunStatus.SUCCEEDED, i)
    assert counts() == few
    # The session and its user, memberships, projects, then one query per list.
    assert few[0] <= 6 and few[1] <= 6, few


def test_one_query_per_list(django_assert_num_queries: Any, member: Any, project: Project, second_project: Project) -> None:
    for i in range(8):
        Run.objects.create(project=project if i % 2 else second_project, name=f"r{i}", status=RunStatus.QUEUED, config={})
        _finished(project if i % 2 else second_project, f"f{i}", RunStatus.FAILED, i)
    with django_assert_num_queries(1):
        rows = selectors.active_runs_for(member, 50)
        assert {r.project.team.name for r in rows} == {"Alignment", "Other lab"}
    with django_assert_num_queries(1):
        rows = selectors.recent_runs_for(member, 5)
        assert len(rows) == 5 and all(r.project.team.name for r in rows)


def test_empty_states_say_what_to_do(
    client_for: Callable[..., Client], django_user_model: Any, member: Any, viewer: Any, project: Project, team: Team
) -> None:
    html = client_for(member).get("/").content.decode()
    assert f'<a href="/projects/{project.pk}/new/">Launch a run in GSM8K</a>' in html
    assert "No run has finished yet" in html

    html = client_for(viewer).get("/").content.decode()
    assert "A team member can launch a run" in html and "/new/" not in html

    no_projects = django_user_model.objects.create_user("newcomer")
    Membership.objects.create(user=no_projects, team=Team.objects.create(name="Empty", slug="empty"), role=Role.ADMIN)
    html = client_for(no_projects).get("/").content.decode()
    assert "a team admin can create one" in html and "No projects in this team yet" in html


def test_the_page_follows_each_project_or_polls_beyond_the_limit(
    client_for: Callable[..., Client], member: Any, project: Project, team: Team
) -> None:
    def live(html: str) -> dict[str, Any]:
        return json.loads(re.search(r'<script id="home-live" type="application/json">(.*?)</script>', html).group(1))

    html = client_for(member).get("/").content.decode()
    assert live(html) == {"projects": [project.pk], "poll_seconds": 0}
    assert 'hx-trigger="home-runs-changed from:body"' in html and "tributary/home.js" in html

    for i in range(MAX_SOCKETS):
        Project.objects.create(team=team, name=f"p{i}", slug=f"p{i}")
    html = client_for(member).get("/").content.decode()
    assert live(html) == {"projects": [], "poll_seconds": POLL_SECONDS}
    assert f'hx-trigger="home-runs-changed from:body, every {POLL_SECONDS}s"' in html


def test_beyond_the_limit_only_the_newest_active_runs_are_listed(
    client_for: Callable[..., Client], member: Any, project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("webapp.pages.home.ACTIVE_LIMIT", 2)
    runs = [Run.objects.create(project=project, name=f"q{i}", config={}) for i in range(3)]
    active = _section(client_for(member).get("/").content.decode(), "active-runs")
    assert _ids(active, "active") == [runs[2].pk, runs[1].pk]
    assert "2+</span>" in active and "Only the newest 2 are listed" in active
