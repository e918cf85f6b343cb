"""A run's housekeeping through the API, with the run page's rules: archive and restore
(member), delete after naming the run (admin; a queued or running run is a 409)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client

from jobs.supervisor import RUNS_DIR_ENV
from webapp.runs.choices import RunStatus
from webapp.runs.models import MetricPoint, Run


@pytest.fixture
def finished(make_run: Callable[..., Run]) -> Run:
    return make_run(name="api run/1", status=RunStatus.SUCCEEDED)


def test_archive_and_restore(
    client_for: Callable[..., Client], member: Any, viewer: Any, finished: Run
) -> None:
    assert client_for(viewer).post(f"/api/runs/{finished.pk}/archive").status_code == 403
    client = client_for(member)
    body = client.post(f"/api/runs/{finished.pk}/archive").json()
    assert body["id"] == finished.pk and body["archived_at"] is not None
    body = client.post(f"/api/runs/{finished.pk}/restore").json()
    assert body["archived_at"] is None
    finished.refresh_from_db()
    assert finished.archived_at is None


def test_an_active_run_is_a_409(
    client_for: Callable[..., Client], admin: Any, make_run: Callable[..., Run]
) -> None:
    run = make_run(name="busy", status=RunStatus.RUNNING)
    client = client_for(admin)
    archive = client.post(f"/api/runs/{run.pk}/archive")
    assert archive.status_code == 409 and "cancel it first" in archive.json()["detail"]
    delete = client.delete(f"/api/runs/{run.pk}?confirm=busy")
    assert delete.status_code == 409 and "cancel it first" in delete.json()["detail"]
    assert Run.objects.filter(pk=run.pk).exists()


def test_delete_needs_the_admin_and_the_name(
    client_for: Callable[..., Client],
    admin: Any,
    member: Any,
    outsider: Any,
    finished: Run,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    (tmp_path / str(finished.pk)).mkdir()
    MetricPoint.objects.create(run=finished, name="reward/mean", step=1, value=1.0, time=finished.created_at)
    url = f"/api/runs/{finished.pk}?confirm={quote(finished.name)}"
    assert client_for(outsider).delete(url).status_code == 404
    refused = client_for(member).delete(url)
    assert refused.status_code == 403 and "admin role" in refused.json()["detail"]
    wrong = client_for(admin).delete(f"/api/runs/{finished.pk}?confirm=api")
    assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"] == ["query", "confirm"]
    assert client_for(admin).delete(f"/api/runs/{finished.pk}").status_code == 422  # no confirm at all
    with django_capture_on_commit_callbacks(execute=True):
        done = client_for(admin).delete(url)
    assert done.status_code == 200, done.content
    assert done.json() | {"files": "?"} == {
        "id": finished.pk, "name": "api run/1", "metric_points": 1, "samples": 0, "log_lines": 0,
        "checkpoints": 0, "checkpoint_bytes": 0, "share_links": 0, "files": "?",
    }  # fmt: skip
    assert done.json()["files"] == "removed here" and not (tmp_path / str(finished.pk)).exists()
    assert client_for(admin).get(f"/api/runs/{finished.pk}").status_code == 404


def test_the_lists_leave_archived_things_out_as_the_pages_do(
    client_for: Callable[..., Client], viewer: Any, finished: Run, make_run: Callable[..., Run], project: Any
) -> None:
    """A script listing a project's runs or a team's projects sees what the pages list; the
    archived ones come with ``archived=true``, and a run queued again is listed while active."""
    from webapp.runs.housekeeping import archive_run
    from webapp.teams.projects import archive_project

    active_again = make_run(name="resumed", status=RunStatus.SUCCEEDED)
    kept = make_run(name="kept", status=RunStatus.SUCCEEDED)
    archive_run(finished)
    archive_run(active_again)
    Run.objects.filter(pk=active_again.pk).update(status=RunStatus.RUNNING)
    client = client_for(viewer)

    def ids(**query: Any) -> set[int]:
        return {item["id"] for item in client.get(f"/api/projects/{project.pk}/runs", query).json()["items"]}

    assert ids() == {kept.pk, active_again.pk}
    assert ids(archived="true") == {finished.pk}
    body = client.get(f"/api/runs/{finished.pk}").json()
    assert body["archived_at"] is not None

    other = project.team.projects.create(name="Old", slug="old")
    archive_project(other)
    listed = client.get(f"/api/teams/{project.team_id}/projects").json()
    assert [p["id"] for p in listed] == [project.pk] and listed[0]["archived_at"] is None
    shelved = client.get(f"/api/teams/{project.team_id}/projects", {"archived": "true"}).json()
    assert [p["id"] for p in shelved] == [other.pk] and shelved[0]["archived_at"] is not None
