"""The team page: members and roles, projects; who may see and manage what."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from webapp.runs.choices import RunStatus
from webapp.runs.models import Run
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team


@pytest.fixture
def newcomer(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user(username="erin-new")


def _url(team: Team, suffix: str = "") -> str:
    return f"/teams/{team.pk}/{suffix}"


def _role(team: Team, user: Any) -> str | None:
    return Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()


# --- seeing the page -----------------------------------------------------------------------


def test_the_team_page_needs_a_sign_in(client: Client, team: Team) -> None:
    response = client.get(_url(team))
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_an_outsider_gets_404_for_the_page_and_every_action(
    client_for: Callable[..., Client], outsider: Any, admin: Any, member: Any, team: Team
) -> None:
    client = client_for(outsider)
    assert client.get(_url(team)).status_code == 404
    assert client.get("/teams/999999/").status_code == 404
    assert (
        client.post(_url(team, "members/"), {"username": "dave-outsider", "role": "admin"}).status_code == 404
    )
    assert client.post(_url(team, f"members/{member.pk}/role/"), {"role": "admin"}).status_code == 404
    assert client.post(_url(team, f"members/{member.pk}/remove/")).status_code == 404
    assert client.post(_url(team, "projects/"), {"name": "Mine"}).status_code == 404
    assert _role(team, outsider) is None and _role(team, member) == Role.MEMBER
    assert not Project.objects.filter(team=team).exists()


def test_members_and_projects_are_listed_with_roles(
    client_for: Callable[..., Client], admin: Any, member: Any, viewer: Any, project: Project, make_run: Any
) -> None:
    make_run(status=RunStatus.RUNNING)
    make_run(status=RunStatus.SUCCEEDED)
    page = client_for(viewer).get(_url(project.team)).content.decode()
    assert 'data-username="alice-admin" data-role="admin"' in page
    assert 'data-username="bob-member" data-role="member"' in page
    assert 'data-username="carol-viewer" data-role="viewer"' in page
    assert f'href="/projects/{project.pk}/"' in page and "GSM8K" in page
    assert "2 runs, 1 active" in page
    assert "you are viewer" in page


@pytest.mark.parametrize("persona", ["member", "viewer"])
def test_members_and_viewers_see_no_management(
    request: pytest.FixtureRequest, client_for: Callable[..., Client], admin: Any, persona: str, team: Team
) -> None:
    user = request.getfixturevalue(persona)
    page = client_for(user).get(_url(team)).content.decode()
    assert 'id="member-add-form"' not in page and 'id="project-create-form"' not in page
    assert "/remove/" not in page and "/role/" not in page
    assert "Only a team admin can add members" in page


@pytest.mark.parametrize("persona", ["member", "viewer"])
def test_members_and_viewers_are_refused_every_action(
    request: pytest.FixtureRequest,
    client_for: Callable[..., Client],
    admin: Any,
    persona: str,
    team: Team,
    newcomer: Any,
) -> None:
    user = request.getfixturevalue(persona)
    client = client_for(user)
    assert (
        client.post(_url(team, "members/"), {"username": newcomer.username, "role": "viewer"}).status_code
        == 403
    )
    assert client.post(_url(team, f"members/{user.pk}/role/"), {"role": "admin"}).status_code == 403
    assert client.post(_url(team, f"members/{admin.pk}/remove/")).status_code == 403
    assert client.post(_url(team, "projects/"), {"name": "Sneaky"}).status_code == 403
    assert _role(team, newcomer) is None and _role(team, user) == persona and _role(team, admin) == Role.ADMIN
    assert not Project.objects.filter(team=team).exists()


def test_the_admin_sees_the_management_forms(
    client_for: Callable[..., Client], admin: Any, member: Any, team: Team
) -> None:
    page = client_for(admin).get(_url(team)).content.decode()
    assert 'id="member-add-form"' in page and 'id="project-create-form"' in page
    assert f"/teams/{team.pk}/members/{member.pk}/remove/" in page
    assert 'aria-label="Role of bob-member"' in page
    # The only admin can be neither removed nor demoted.
    assert f"/teams/{team.pk}/members/{admin.pk}/remove/" not in page
    assert "last admin" in page


# --- members -------------------------------------------------------------------------------


def test_an_admin_adds_a_member_by_username(
    client_for: Callable[..., Client], admin: Any, team: Team, newcomer: Any
) -> None:
    client = client_for(admin)
    response = client.post(_url(team, "members/"), {"username": " erin-new ", "role": "viewer"})
    assert response.status_code == 302 and response["Location"] == _url(team)
    assert _role(team, newcomer) == Role.VIEWER
    page = client.get(_url(team)).content.decode()
    assert "erin-new joined Alignment as viewer" in page
    assert 'data-username="erin-new" data-role="viewer"' in page


def test_adding_an_unknown_user_or_an_existing_member_says_why(
    client_for: Callable[..., Client], admin: Any, member: Any, team: Team
) -> None:
    client = client_for(admin)
    unknown = client.post(_url(team, "members/"), {"username": "nobody", "role": "member"})
    assert unknown.status_code == 400
    assert "No user is called &#x27;nobody&#x27;" in unknown.content.decode()
    again = client.post(_url(team, "members/"), {"username": "bob-member", "role": "admin"})
    assert again.status_code == 400 and "already in this team" in again.content.decode()
    assert _role(team, member) == Role.MEMBER
    bad_role = client.post(_url(team, "members/"), {"username": "bob-member", "role": "owner"})
    assert bad_role.status_code == 400 and 'id="error-member-role"' in bad_role.content.decode()


def test_an_admin_changes_roles(
    client_for: Callable[..., Client], admin: Any, member: Any, team: Team
) -> None:
    client = client_for(admin)
    response = client.post(_url(team, f"members/{member.pk}/role/"), {"role": "admin"})
    assert response.status_code == 302 and _role(team, member) == Role.ADMIN
    # Now two admins: the first may step down.
    client.post(_url(team, f"members/{admin.pk}/role/"), {"role": "viewer"})
    assert _role(team, admin) == Role.VIEWER
    assert client.post(_url(team, f"members/{member.pk}/role/"), {"role": "member"}).status_code == 403


def test_the_last_admin_cannot_be_demoted_or_removed(
    client_for: Callable[..., Client], admin: Any, member: Any, team: Team
) -> None:
    client = client_for(admin)
    demote = client.post(_url(team, f"members/{admin.pk}/role/"), {"role": "member"}, follow=True)
    assert "the team&#x27;s last admin" in demote.content.decode()
    remove = client.post(_url(team, f"members/{admin.pk}/remove/"), follow=True)
    assert "last admin" in remove.content.decode()
    assert _role(team, admin) == Role.ADMIN


def test_an_admin_removes_members_and_may_leave_when_another_admin_remains(
    client_for: Callable[..., Client], admin: Any, member: Any, viewer: Any, team: Team
) -> None:
    client = client_for(admin)
    response = client.post(_url(team, f"members/{viewer.pk}/remove/"))
    assert response.status_code == 302 and _role(team, viewer) is None
    assert client.post(_url(team, "members/999999/remove/")).status_code == 404
    client.post(_url(team, f"members/{member.pk}/role/"), {"role": "admin"})
    leave = client.post(_url(team, f"members/{admin.pk}/remove/"))
    assert leave.status_code == 302 and leave["Location"] == "/"
    assert _role(team, admin) is None
    assert client.get(_url(team)).status_code == 404


def test_actions_need_post(client_for: Callable[..., Client], admin: Any, member: Any, team: Team) -> None:
    client = client_for(admin)
    assert client.get(_url(team, f"members/{member.pk}/remove/")).status_code == 405
    assert client.get(_url(team, "projects/")).status_code == 405


# --- projects ------------------------------------------------------------------------------


def test_an_admin_creates_a_project_with_an_automatic_slug(
    client_for: Callable[..., Client], admin: Any, team: Team
) -> None:
    client = client_for(admin)
    response = client.post(
        _url(team, "projects/"), {"name": "Math RL: v2", "slug": "", "description": "GSM8K "}
    )
    project = Project.objects.get(team=team)
    assert response.status_code == 302 and response["Location"] == f"/projects/{project.pk}/"
    assert (project.name, project.slug, project.description) == ("Math RL: v2", "math-rl-v2", "GSM8K")
    assert "Project Math RL: v2 created." in client.get(response["Location"]).content.decode()


def test_project_slugs_are_unique_per_team_and_checked(
    client_for: Callable[..., Client], admin: Any, team: Team, project: Project, other_team: Team
) -> None:
    client = client_for(admin)
    taken = client.post(_url(team, "projects/"), {"name": "GSM8K"})
    assert taken.status_code == 400 and "already has a project &#x27;gsm8k&#x27;" in taken.content.decode()
    bad = client.post(_url(team, "projects/"), {"name": "x", "slug": "not a slug!"})
    assert bad.status_code == 400 and 'id="error-project-slug"' in bad.content.decode()
    no_letters = client.post(_url(team, "projects/"), {"name": "!!!"})
    assert no_letters.status_code == 400 and "give one" in no_letters.content.decode()
    empty = client.post(_url(team, "projects/"), {"name": "  "})
    assert empty.status_code == 400 and 'id="error-project-name"' in empty.content.decode()
    assert Project.objects.filter(team=team).count() == 1
    # The same slug in another team is fine.
    Project.objects.create(team=other_team, name="Math", slug="math")
    assert client.post(_url(team, "projects/"), {"name": "Math"}).status_code == 302


def test_user_text_is_escaped(
    client_for: Callable[..., Client], admin: Any, team: Team, django_user_model: Any
) -> None:
    Team.objects.filter(pk=team.pk).update(name="<script>alert('team')</script>")
    Project.objects.create(team=team, name="<script>alert(1)</script>", slug="x", description="<b>bold</b>")
    evil = django_user_model.objects.create_user(username="<img src=x>")
    Membership.objects.create(team=team, user=evil, role=Role.VIEWER)
    page = client_for(admin).get(_url(team)).content.decode()
    assert "<script>alert" not in page and "<b>bold</b>" not in page and "<img src=x>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page


def test_the_project_list_is_empty_with_a_hint(
    client_for: Callable[..., Client], admin: Any, viewer: Any, team: Team
) -> None:
    assert "Create the first one below" in client_for(admin).get(_url(team)).content.decode()
    assert "A team admin can create one" in client_for(viewer).get(_url(team)).content.decode()


def test_the_new_run_link_and_runs_of_a_new_project(
    client_for: Callable[..., Client], admin: Any, team: Team
) -> None:
    client = client_for(admin)
    client.post(_url(team, "projects/"), {"name": "Fresh"})
    project = Project.objects.get(team=team, slug="fresh")
    page = client.get(f"/projects/{project.pk}/").content.decode()
    assert "No runs yet" in page and f'href="/projects/{project.pk}/new/"' in page
    assert not Run.objects.filter(project=project).exists()
