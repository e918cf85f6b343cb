"""Self-service teams and projects: anyone signed in makes a team (and is its admin); admins
rename it, and rename, archive and restore its projects; archived projects leave the lists and
keep their pages and runs' URLs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from webapp.runs.choices import RunStatus
from webapp.runs.models import Run
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team


def test_anyone_signed_in_makes_a_team_and_is_its_admin(
    client: Client, client_for: Callable[..., Client], django_user_model: Any, team: Team
) -> None:
    assert client.get("/teams/create/").status_code == 302  # sign in first
    loner = django_user_model.objects.create_user("loner")
    me = client_for(loner)
    assert "create a team" in me.get("/").content.decode()
    response = me.post("/teams/create/", {"name": "  Alignment  "})  # the fixture's team has this name
    made = Team.objects.exclude(pk=team.pk).get()
    assert response.status_code == 302 and response["Location"] == f"/teams/{made.pk}/"
    assert made.name == "Alignment" and made.slug == "alignment-2"
    assert Membership.objects.get(team=made).role == Role.ADMIN
    html = me.get(f"/teams/{made.pk}/").content.decode()
    assert 'id="invite-form"' in html and 'id="team-rename-form"' in html


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("   ", "Give the team a name"),
        ("x" * 101, "At most 100 characters"),
        ("a\x07b", "no control characters"),
    ],
)
def test_a_bad_team_name_names_the_fix(
    client_for: Callable[..., Client], django_user_model: Any, name: str, words: str
) -> None:
    response = client_for(django_user_model.objects.create_user("u")).post("/teams/create/", {"name": name})
    assert response.status_code == 400 and words in response.content.decode()
    assert 'id="error-team-name"' in response.content.decode() and not Team.objects.exists()


def test_admins_rename_the_team(
    client_for: Callable[..., Client], admin: Any, member: Any, viewer: Any, outsider: Any, team: Team
) -> None:
    assert client_for(outsider).post(f"/teams/{team.pk}/rename/", {"name": "X"}).status_code == 404
    for user in (member, viewer):
        assert client_for(user).post(f"/teams/{team.pk}/rename/", {"name": "X"}).status_code == 403
        assert 'id="team-rename-form"' not in client_for(user).get(f"/teams/{team.pk}/").content.decode()
    client = client_for(admin)
    bad = client.post(f"/teams/{team.pk}/rename/", {"name": ""})
    assert bad.status_code == 400 and "Give the team a name" in bad.content.decode()
    assert client.post(f"/teams/{team.pk}/rename/", {"name": "RL Lab"}).status_code == 302
    team.refresh_from_db()
    assert team.name == "RL Lab" and team.slug == "alignment"


def test_admins_rename_archive_and_restore_projects(
    client_for: Callable[..., Client],
    admin: Any,
    member: Any,
    viewer: Any,
    project: Project,
    make_run: Callable[..., Run],
) -> None:
    run = make_run(status=RunStatus.SUCCEEDED)
    base = f"/projects/{project.pk}/"
    for user in (member, viewer):
        client = client_for(user)
        for action in ("rename/", "archive/", "restore/"):
            assert client.post(base + action, {"name": "Mine"}).status_code == 403
        assert 'id="project-admin"' not in client.get(base).content.decode()
    client = client_for(admin)
    assert 'id="project-admin"' in client.get(base).content.decode()
    client.post(base + "rename/", {"name": ""})
    project.refresh_from_db()
    assert project.name == "GSM8K"  # refused, with a message naming the field
    assert client.post(base + "rename/", {"name": "GSM8K v2"}).status_code == 302
    project.refresh_from_db()
    assert project.name == "GSM8K v2" and project.slug == "gsm8k"

    assert client.post(base + "archive/").status_code == 302
    project.refresh_from_db()
    assert project.archived_at is not None
    team_page = client_for(viewer).get(f"/teams/{project.team_id}/").content.decode()
    assert f'data-project-id="{project.pk}"' not in team_page and "Archived projects (1)" in team_page
    assert base not in client_for(viewer).get("/").content.decode()  # not on the landing page either
    archived_page = client_for(viewer).get(f"/teams/{project.team_id}/projects/archived/").content.decode()
    assert f'data-project-id="{project.pk}"' in archived_page and "Restore" not in archived_page  # viewer
    assert "Restore" in client.get(f"/teams/{project.team_id}/projects/archived/").content.decode()
    # Its page and its runs keep their URLs; its page offers no New run.
    page = client_for(member).get(base)
    assert page.status_code == 200 and 'id="project-archived"' in page.content.decode()
    assert 'id="new-run"' not in page.content.decode()
    assert client_for(viewer).get(f"/runs/{run.pk}/").status_code == 200

    assert client.post(base + "restore/").status_code == 302
    project.refresh_from_db()
    assert project.archived_at is None
    assert f'data-project-id="{project.pk}"' in client.get(f"/teams/{project.team_id}/").content.decode()


def test_a_project_with_active_runs_is_not_archived(
    client_for: Callable[..., Client], admin: Any, project: Project, make_run: Callable[..., Run]
) -> None:
    make_run(status=RunStatus.RUNNING)
    response = client_for(admin).post(f"/projects/{project.pk}/archive/", follow=True)
    assert "has 1 queued or running run: cancel them" in response.content.decode()
    project.refresh_from_db()
    assert project.archived_at is None
