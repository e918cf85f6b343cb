"""A run's housekeeping from its page: rename inline (members), archive and restore (members),
delete after typing its name (admins), which purges its rows and its run directory. Viewers see
no control and get 403; outsiders 404. Archived runs leave the runs table (the page and the
fragment htmx reads again on live changes) and the landing page, and come back on Restore."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from jobs.supervisor import RUNS_DIR_ENV
from webapp.runs import housekeeping
from webapp.runs.choices import ParentKind, RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample, ShareLink
from webapp.runs.output import full_log_path
from webapp.teams.models import Project

T0 = datetime(2026, 1, 1, tzinfo=UTC)
HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture
def done(make_run: Callable[..., Run]) -> Run:
    return make_run(name="baseline-7", status=RunStatus.SUCCEEDED, finished_at=T0)


def _fill(run: Run) -> None:
    """Rows of every kind a run holds."""
    MetricPoint.objects.bulk_create(
        MetricPoint(run=run, name=name, step=s, value=s / 10, time=T0, seq=s)
        for s in range(1, 6)
        for name in ("reward/mean", "actor/entropy")
    )
    Sample.objects.bulk_create(
        Sample(run=run, step=1, seq=10, index=i, prompt="p", completion="c") for i in range(3)
    )
    LogLine.objects.create(run=run, seq=11, level="info", message="hello", time=T0)
    Checkpoint.objects.create(run=run, seq=12, step=5, path=f"/runs/{run.pk}/checkpoints/step_5", bytes=2048)
    ShareLink.create(run, None)


def _rows(run_id: int) -> dict[str, int]:
    return {
        model.__name__: model.objects.filter(run_id=run_id).count()
        for model in (MetricPoint, Sample, LogLine, Checkpoint, ShareLink)
    }


# --- who sees what -----------------------------------------------------------------------------


def test_controls_follow_the_role(
    client_for: Callable[..., Client], admin: Any, member: Any, viewer: Any, done: Run
) -> None:
    url = f"/runs/{done.pk}/"
    viewer_page = client_for(viewer).get(url).content.decode()
    for control in ('id="rename-form"', 'id="archive-form"', 'id="delete-link"'):
        assert control not in viewer_page
    member_page = client_for(member).get(url).content.decode()
    assert 'id="rename-form"' in member_page and 'id="archive-form"' in member_page
    assert 'id="delete-link"' not in member_page
    admin_page = client_for(admin).get(url).content.decode()
    assert 'id="delete-link"' in admin_page
    assert f'id="delete-link" href="/runs/{done.pk}/delete/"' in admin_page


def test_viewers_get_403_and_outsiders_404(
    client_for: Callable[..., Client], member: Any, viewer: Any, outsider: Any, done: Run
) -> None:
    for path in ("rename/", "archive/", "restore/", "delete/"):
        assert client_for(viewer).post(f"/runs/{done.pk}/{path}", {"name": "x"}).status_code == 403
        assert client_for(outsider).post(f"/runs/{done.pk}/{path}", {"name": "x"}).status_code == 404
    refused = client_for(member).post(f"/runs/{done.pk}/delete/", {"confirm": done.name})
    assert refused.status_code == 403 and "needs the admin role" in refused.content.decode()
    assert client_for(member).get(f"/runs/{done.pk}/delete/").status_code == 403
    done.refresh_from_db()
    assert done.name == "baseline-7" and done.archived_at is None


# --- rename ------------------------------------------------------------------------------------


def test_rename_inline_through_htmx(client_for: Callable[..., Client], member: Any, done: Run) -> None:
    client = client_for(member)
    response = client.post(f"/runs/{done.pk}/rename/", {"name": "  grpo   lr 3e-6 "}, **HTMX)
    html = response.content.decode()
    assert response.status_code == 200 and html.lstrip().startswith("<title>grpo lr 3e-6 · Tributary</title>")
    assert '<div class="run-title-box"' in html
    assert '<h1 id="run-title">grpo lr 3e-6 <span class="muted">' in html and 'id="rename-saved"' in html
    done.refresh_from_db()
    assert done.name == "grpo lr 3e-6"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "name: give the run a name"),
        ("x" * 201, "name: at most 200 characters"),
        ("a\x1bb", "name: no control"),
    ],
)
def test_a_bad_name_is_refused_at_the_field(
    client_for: Callable[..., Client], member: Any, done: Run, name: str, words: str
) -> None:
    response = client_for(member).post(f"/runs/{done.pk}/rename/", {"name": name}, **HTMX)
    html = response.content.decode()
    match = re.search(r'id="rename-error">([^<]*)<', html)
    assert match and words in match.group(1)
    assert 'aria-invalid="true"' in html and "<details" in html and " open>" in html
    done.refresh_from_db()
    assert done.name == "baseline-7"


def test_rename_without_javascript_redirects(
    client_for: Callable[..., Client], member: Any, done: Run
) -> None:
    response = client_for(member).post(f"/runs/{done.pk}/rename/", {"name": "plain"}, follow=True)
    assert (
        response.redirect_chain[-1][0] == f"/runs/{done.pk}/"
        and "Renamed to plain." in response.content.decode()
    )


# --- archive ----------------------------------------------------------------------------------


def test_archived_runs_leave_the_lists_and_come_back(
    client_for: Callable[..., Client], member: Any, project: Project, done: Run, make_run: Callable[..., Run]
) -> None:
    other = make_run(name="kept", status=RunStatus.FAILED, finished_at=T0)
    client = client_for(member)
    table = f"/projects/{project.pk}/"
    assert f'id="run-row-{done.pk}"' in client.get(table).content.decode()

    response = client.post(f"/runs/{done.pk}/archive/", follow=True)
    assert "was archived" in response.content.decode() and 'id="run-archived"' in response.content.decode()
    assert (
        'id="restore-form"' in response.content.decode()
        and 'id="archive-form"' not in response.content.decode()
    )
    done.refresh_from_db()
    assert done.archived_at is not None

    for html in (
        client.get(table).content.decode(),
        client.get(table, **HTMX).content.decode(),  # what the live table reads again
        client.get(table + "?status=succeeded").content.decode(),
    ):
        assert f'id="run-row-{done.pk}"' not in html
    assert f'id="run-row-{other.pk}"' in client.get(table).content.decode()
    home = client.get("/home/runs/").content.decode()
    assert f'data-run-id="{done.pk}"' not in home and f'data-run-id="{other.pk}"' in home
    shown = client.get(table + "?archived=1", **HTMX).content.decode()
    assert f'id="run-row-{done.pk}"' in shown and f'id="run-row-{other.pk}"' not in shown
    assert client.get(f"/runs/{done.pk}/").status_code == 200  # still reachable by its URL

    assert client.post(f"/runs/{done.pk}/restore/").status_code == 302
    assert f'id="run-row-{done.pk}"' in client.get(table).content.decode()
    assert f'data-run-id="{done.pk}"' in client.get("/home/runs/").content.decode()


@pytest.mark.parametrize("status", [RunStatus.QUEUED, RunStatus.RUNNING])
def test_an_active_run_is_not_archived(
    client_for: Callable[..., Client], member: Any, make_run: Callable[..., Run], status: RunStatus
) -> None:
    run = make_run(status=status)
    page = client_for(member).get(f"/runs/{run.pk}/").content.decode()
    assert 'id="archive-form"' not in page
    response = client_for(member).post(f"/runs/{run.pk}/archive/", follow=True)
    assert f"is {status.value}: cancel it first" in response.content.decode()
    run.refresh_from_db()
    assert run.archived_at is None


def test_an_archived_run_queued_again_is_listed(project: Project, done: Run) -> None:
    """Should an archived run be queued again (a resume through the API), the lists show it."""
    housekeeping.archive_run(done)
    runs = Run.objects.filter(project=project)
    assert list(housekeeping.listed(runs)) == [] and list(housekeeping.archived(runs)) == [done]
    Run.objects.filter(pk=done.pk).update(status=RunStatus.QUEUED)
    assert list(housekeeping.listed(runs)) == [done] and list(housekeeping.archived(runs)) == []


# --- delete ----------------------------------------------------------------------------------


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worker's runs directory, reachable from the web app (embedded mode, shared storage)."""
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv(RUNS_DIR_ENV, str(root))
    return root


def _run_files(root: Path, run: Run) -> Path:
    workdir = root / str(run.pk)
    (workdir / "checkpoints" / "step_5").mkdir(parents=True)
    (workdir / "checkpoints" / "step_5" / "model.safetensors").write_bytes(b"\0" * 2048)
    (workdir / "events.jsonl").write_text('{"seq": 1}\n')
    return workdir


def test_delete_asks_for_the_name_then_purges_rows_and_files(
    client_for: Callable[..., Client],
    admin: Any,
    project: Project,
    done: Run,
    make_run: Callable[..., Run],
    runs_dir: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    _fill(done)
    workdir = _run_files(runs_dir, done)
    neighbour = make_run(name="neighbour", status=RunStatus.SUCCEEDED)
    _fill(neighbour)
    neighbour_dir = _run_files(runs_dir, neighbour)
    child = make_run(name="child", status=RunStatus.FAILED, parent=done, parent_kind=ParentKind.FORK)
    client = client_for(admin)
    full_logs = [full_log_path(done.pk), full_log_path(neighbour.pk)]  # the web app's copies of engine.log
    for path in full_logs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("engine output\n")

    page = client.get(f"/runs/{done.pk}/delete/").content.decode()
    assert "10 metric points" in page and "3 samples" in page and "1 log line" in page
    assert "1 checkpoint (2.0\xa0KB)" in page and "1 share link" in page

    wrong = client.post(f"/runs/{done.pk}/delete/", {"confirm": "baseline"})
    match = re.search(r'id="error-confirm">([^<]*)<', wrong.content.decode())
    assert (
        wrong.status_code == 400 and match and "confirm: type the run&#x27;s name exactly" in match.group(1)
    )
    assert Run.objects.filter(pk=done.pk).exists() and workdir.exists()

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/runs/{done.pk}/delete/", {"confirm": " baseline-7 "}, follow=True)
    assert response.redirect_chain[0] == (f"/projects/{project.pk}/", 302)
    html = response.content.decode()
    assert (
        "Run baseline-7 was deleted with its 10 metric points, 3 samples, 1 log line and 1 checkpoint;"
        in html
    )
    assert "its files were removed" in html
    assert not Run.objects.filter(pk=done.pk).exists()
    assert _rows(done.pk) == dict.fromkeys(_rows(done.pk), 0)
    assert not workdir.exists() and not full_logs[0].exists()
    # Nothing of another run goes; a child keeps its row, without its parent.
    assert full_logs[1].read_text() == "engine output\n"
    assert _rows(neighbour.pk) == {
        "MetricPoint": 10,
        "Sample": 3,
        "LogLine": 1,
        "Checkpoint": 1,
        "ShareLink": 1,
    }
    assert (neighbour_dir / "checkpoints" / "step_5" / "model.safetensors").exists()
    child.refresh_from_db()
    assert child.parent_id is None and child.parent_kind == ""
    assert client.get(f"/runs/{done.pk}/").status_code == 404


@pytest.mark.parametrize("status", [RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING])
def test_an_active_run_is_not_deleted(
    client_for: Callable[..., Client],
    admin: Any,
    make_run: Callable[..., Run],
    status: RunStatus,
    runs_dir: Path,
) -> None:
    run = make_run(name="busy", status=status)
    workdir = _run_files(runs_dir, run)
    client = client_for(admin)
    assert 'id="delete-link"' in client.get(f"/runs/{run.pk}/").content.decode()  # its page says why not
    page = client.get(f"/runs/{run.pk}/delete/").content.decode()
    assert 'id="delete-active"' in page and "Cancel it on its page" in page
    response = client.post(f"/runs/{run.pk}/delete/", {"confirm": "busy"})
    assert response.status_code == 409
    assert f"Cannot delete: run {run.pk} is {status.value}: cancel it first" in response.content.decode()
    assert Run.objects.filter(pk=run.pk).exists() and workdir.exists()


def test_a_run_an_active_run_resumes_from_is_not_deleted(
    admin: Any, done: Run, make_run: Callable[..., Run], runs_dir: Path
) -> None:
    _fill(done)
    checkpoint = Checkpoint.objects.get(run=done)
    make_run(
        name="continuing",
        status=RunStatus.RUNNING,
        parent=done,
        parent_kind=ParentKind.RESUME,
        resume_from=checkpoint,
    )
    with pytest.raises(housekeeping.Refused, match=r"continuing .* resumes from this run's checkpoints"):
        housekeeping.delete_run(done, done.name)
    assert Run.objects.filter(pk=done.pk).exists() and _rows(done.pk)["Checkpoint"] == 1


def test_a_link_in_place_of_the_run_directory_is_removed_not_followed(
    tmp_path: Path, done: Run, runs_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (runs_dir / str(done.pk)).symlink_to(elsewhere, target_is_directory=True)
    with django_capture_on_commit_callbacks(execute=True):
        purged = housekeeping.delete_run(done, done.name)
    assert purged.files == "removed here"
    assert not (runs_dir / str(done.pk)).exists() and (elsewhere / "keep.txt").read_text() == "keep"


def test_a_rolled_back_delete_keeps_the_files(
    done: Run, runs_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    workdir = _run_files(runs_dir, done)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        housekeeping.delete_run(done, done.name)
    assert callbacks and workdir.exists()  # the files wait for the commit
