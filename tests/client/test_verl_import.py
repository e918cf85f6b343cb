"""The project page's "Import a verl run": verl's own files (``fixtures/verl/``) uploaded through
the page become a finished external run whose stored metrics and samples equal the files, read
by the same code ``follow`` reads them with and stored through the ingest path."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from tests.client.test_verl_follow import (
    METRICS,
    ROLLOUTS,
    as_stored,
    assert_grouped,
    expected_metrics,
    expected_samples,
)
from webapp.runs.models import MetricPoint, Run, Sample
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project
from webapp.teams.services import create_team

pytestmark = pytest.mark.django_db


@pytest.fixture
def project(django_user_model: Any) -> Project:
    owner = django_user_model.objects.create_user("owner")
    return Project.objects.create(team=create_team("Verl", owner), name="Imports", slug="imports")


def upload(path: Path, name: str | None = None) -> SimpleUploadedFile:
    return SimpleUploadedFile(name or path.name, path.read_bytes())


def rollouts_zip() -> SimpleUploadedFile:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in ROLLOUTS.glob("*.jsonl"):
            archive.write(path, f"rollout_data/{path.name}")
    return SimpleUploadedFile("rollouts.zip", buffer.getvalue())


def stored(run: Run) -> tuple[dict[tuple[str, int], float], list[dict[str, Any]]]:
    metrics = {(p.name, p.step): p.value for p in MetricPoint.objects.filter(run=run)}
    samples = [
        {"step": s.step, "prompt": s.prompt, "completion": s.completion, "reward": s.reward, "extra": s.extra}
        for s in Sample.objects.filter(run=run).order_by("seq", "index")
    ]
    return metrics, samples


@pytest.mark.parametrize("packed", [False, True], ids=["files", "zip"])
def test_it_imports_a_verl_run(client: Any, project: Project, packed: bool) -> None:
    client.force_login(project.team.memberships.get().user)
    page = client.get(reverse("project", args=[project.pk]))
    assert reverse("project-import-verl", args=[project.pk]) in page.content.decode()
    rollouts = [rollouts_zip()] if packed else [upload(p) for p in sorted(ROLLOUTS.glob("*.jsonl"))]
    response = client.post(
        reverse("project-import-verl", args=[project.pk]),
        {"name": "verl fixture", "metrics": upload(METRICS), "rollouts": rollouts},
    )
    run = Run.objects.get(project=project)
    assert response.status_code == 302 and response["Location"] == run.get_absolute_url()
    assert (run.status, run.is_external, run.name) == ("succeeded", True, "verl fixture")
    metrics, samples = stored(run)
    assert metrics == expected_metrics(METRICS.read_bytes().splitlines())
    assert as_stored(samples) == expected_samples(ROLLOUTS)
    assert_grouped(samples)
    assert "skipped nothing" in run.status_message


def test_it_rejects_a_file_that_is_no_rollout_dump(client: Any, project: Project) -> None:
    client.force_login(project.team.memberships.get().user)
    response = client.post(
        reverse("project-import-verl", args=[project.pk]),
        {"name": "x", "rollouts": [SimpleUploadedFile("notes.txt", b"hello\n")]},
    )
    assert response.status_code == 400
    assert "notes.txt" in response.content.decode() and "&lt;step&gt;.jsonl" in response.content.decode()
    assert not Run.objects.filter(project=project).exists()


def test_it_counts_what_verl_lines_cannot_carry(client: Any, project: Project) -> None:
    client.force_login(project.team.memberships.get().user)
    lines = METRICS.read_bytes() + b'{"step":5,"data":{"actor/entropy":null,"note":"text"}}\n{"step":6,"da'
    response = client.post(
        reverse("project-import-verl", args=[project.pk]),
        {"name": "torn", "metrics": SimpleUploadedFile("m.jsonl", lines)},
    )
    assert response.status_code == 302
    run = Run.objects.get(project=project)
    assert "1 unreadable lines, 1 non-numeric metric values, 1 non-finite" in run.status_message
    assert stored(run)[0] == expected_metrics(METRICS.read_bytes().splitlines())


@pytest.mark.parametrize("role", [Role.VIEWER, None], ids=["viewer", "outsider"])
def test_it_refuses_who_may_not_launch(
    client: Any, project: Project, django_user_model: Any, role: Role
) -> None:
    user = django_user_model.objects.create_user("someone")
    if role is not None:
        Membership.objects.create(team=project.team, user=user, role=role)
    client.force_login(user)
    response = client.post(
        reverse("project-import-verl", args=[project.pk]), {"name": "x", "metrics": upload(METRICS)}
    )
    assert response.status_code == (403 if role is not None else 404)
    assert not Run.objects.filter(project=project).exists()


def test_an_import_that_fails_part_way_leaves_no_run(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One transaction: a store that fails after the first batch (the disk, the database) rolls
    the whole import back, so no half-imported run stays "running" (nothing sweeps external runs)."""
    from webapp.runs import imports

    calls: list[int] = []
    real = imports.store_events

    def failing(run_id: int, events: list[dict[str, Any]]) -> Any:
        calls.append(len(events))
        if len(calls) == 2:
            raise RuntimeError("the database went away")
        return real(run_id, events)

    monkeypatch.setattr(imports, "STORE_BATCH", 5)
    monkeypatch.setattr(imports, "store_events", failing)
    user = project.team.memberships.get().user
    with pytest.raises(RuntimeError):
        imports.import_verl_run(project, user, name="half", metrics=(METRICS).read_bytes(), rollouts={})
    assert len(calls) == 2 and not Run.objects.filter(project=project).exists()
