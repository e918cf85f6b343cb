"""Who may do what through the API: viewer < member < admin, and other teams see nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.webapp.api_endpoints import JSON, TEAM_ENDPOINTS, call, over_endpoints
from webapp.runs.choices import RunStatus
from webapp.runs.models import Checkpoint, Run, ShareLink
from webapp.teams.models import Project, Team

# The writes a viewer may not do, and the role each needs.
WRITES = {
    ("post", "/api/teams/{team}/projects"): "admin",
    ("post", "/api/projects/{project}/runs"): "member",
    ("patch", "/api/runs/{run}"): "member",
    ("post", "/api/runs/{run}/cancel"): "member",
    ("post", "/api/runs/{run}/resume"): "member",
    ("post", "/api/runs/{run}/fork"): "member",
    ("post", "/api/runs/{run}/ingest-token"): "member",
    ("post", "/api/runs/external"): "member",
    ("get", "/api/runs/{run}/shares"): "member",
    ("post", "/api/runs/{run}/shares"): "member",
    ("delete", "/api/runs/{run}/shares/{share}"): "member",
}


@pytest.fixture
def stopped_run(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> Run:
    """A failed run with a checkpoint: it can be resumed."""
    run = make_run(name="crashed", config=valid_config, status=RunStatus.FAILED, last_step=10, last_seq=40)
    Checkpoint.objects.create(run=run, seq=30, step=10, path="runs/crashed/ckpt-10", bytes=1)
    return run


@pytest.fixture
def ids(team: Team, project: Project, stopped_run: Run, member: Any) -> dict[str, int]:
    return {
        "team": team.pk,
        "project": project.pk,
        "run": stopped_run.pk,
        "checkpoint": stopped_run.checkpoints.get().pk,
        "share": ShareLink.create(stopped_run, member).pk,
    }


def snapshot(run: Run) -> dict[str, Any]:
    run.refresh_from_db()
    return {
        "status": run.status,
        "notes": run.notes,
        "cancel_requested_at": run.cancel_requested_at,
        "runs": Run.objects.count(),
        "projects": Project.objects.count(),
        "shares": list(ShareLink.objects.values_list("pk", "revoked_at")),
    }


@over_endpoints(TEAM_ENDPOINTS)
def test_outsider_gets_404_on_every_endpoint_of_another_team(
    method: str,
    path: str,
    body: Any,
    ids: dict[str, int],
    outsider: Any,
    stopped_run: Run,
    client_for: Callable[..., Client],
    token_for: Callable[[Any], str],
) -> None:
    before = snapshot(stopped_run)
    # The outsider is an admin of their own team: a role there opens nothing here.
    session = call(client_for(outsider), method, path, body, ids)
    assert session.status_code == 404, session.content
    assert "not found" in session.json()["detail"]
    token_client = client_for(None, HTTP_AUTHORIZATION=f"Bearer {token_for(outsider)}")
    assert call(token_client, method, path, body, ids).status_code == 404
    assert snapshot(stopped_run) == before
    # The 404 reads the same as for an id that does not exist: it reveals nothing.
    missing = {key: value + 10_000 for key, value in ids.items()}
    assert call(client_for(outsider), method, path, body, missing).status_code == 404


def test_outsider_lists_only_their_own_teams(
    outsider: Any, team: Team, client_for: Callable[..., Client]
) -> None:
    client = client_for(outsider)
    assert [t["slug"] for t in client.get("/api/teams").json()] == ["other-lab"]
    assert [t["slug"] for t in client.get("/api/me").json()["teams"]] == ["other-lab"]


@over_endpoints(TEAM_ENDPOINTS)
def test_viewer_reads_everything_and_writes_nothing(
    method: str,
    path: str,
    body: Any,
    ids: dict[str, int],
    viewer: Any,
    stopped_run: Run,
    client_for: Callable[..., Client],
) -> None:
    before = snapshot(stopped_run)
    response = call(client_for(viewer), method, path, body, ids)
    needs = WRITES.get((method, path))
    if needs is None:
        assert response.status_code == 200, response.content
    else:
        assert response.status_code == 403, response.content
        detail = response.json()["detail"]
        assert f"needs the {needs} role" in detail and "you are viewer" in detail
        assert snapshot(stopped_run) == before


@pytest.mark.parametrize(
    ("method", "path", "body", "expected"),
    [
        ("post", "/api/projects/{project}/runs", {"config": {}}, 201),
        ("patch", "/api/runs/{run}", {"notes": "ok"}, 200),
        ("post", "/api/runs/{run}/resume", {}, 200),
        ("post", "/api/runs/{run}/fork", {"changes": {"trainer": {"total_steps": 3}}}, 201),
        ("get", "/api/runs/{run}/shares", None, 200),
        ("post", "/api/runs/{run}/shares", None, 201),
        ("delete", "/api/runs/{run}/shares/{share}", None, 204),
        ("post", "/api/teams/{team}/projects", {"name": "Member project"}, 403),
    ],
)
def test_member_launches_and_edits_but_does_not_create_projects(
    method: str,
    path: str,
    body: Any,
    expected: int,
    ids: dict[str, int],
    member: Any,
    client_for: Callable[..., Client],
) -> None:
    response = call(client_for(member), method, path, body, ids)
    assert response.status_code == expected, response.content


def test_member_cancels_an_active_run(
    make_run: Callable[..., Run], member: Any, client_for: Callable[..., Client]
) -> None:
    run = make_run(status=RunStatus.QUEUED)
    assert client_for(member).post(f"/api/runs/{run.pk}/cancel").status_code == 200


def test_admin_creates_projects(admin: Any, team: Team, client_for: Callable[..., Client]) -> None:
    client = client_for(admin)
    response = client.post(
        f"/api/teams/{team.pk}/projects",
        {"name": "Math RL", "description": "GSM8K and MATH"},
        content_type=JSON,
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["slug"] == "math-rl" and body["team"]["id"] == team.pk and body["role"] == "admin"
    assert body["run_counts"]["queued"] == 0
    assert Project.objects.filter(team=team, slug="math-rl", description="GSM8K and MATH").exists()
    # The slug is unique per team: a second one is a 422 naming the field.
    again = client.post(f"/api/teams/{team.pk}/projects", {"name": "Math RL"}, content_type=JSON)
    assert again.status_code == 422
    assert again.json()["detail"][0]["loc"] == ["body", "payload", "slug"]
    bad = client.post(
        f"/api/teams/{team.pk}/projects", {"name": "x", "slug": "Not A Slug"}, content_type=JSON
    )
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "payload", "slug"]
    listed = client.get(f"/api/teams/{team.pk}/projects").json()
    assert [p["slug"] for p in listed] == ["math-rl"]


def test_team_detail_lists_members(
    team: Team, admin: Any, member: Any, viewer: Any, client_for: Callable[..., Client]
) -> None:
    body = client_for(viewer).get(f"/api/teams/{team.pk}").json()
    assert body["role"] == "viewer"
    assert {(m["username"], m["role"]) for m in body["members"]} == {
        ("alice-admin", "admin"),
        ("bob-member", "member"),
        ("carol-viewer", "viewer"),
    }


def test_run_permissions_follow_the_role(
    api_run: Run, viewer: Any, member: Any, client_for: Callable[..., Client]
) -> None:
    as_viewer = client_for(viewer).get(f"/api/runs/{api_run.pk}").json()
    assert as_viewer["role"] == "viewer"
    assert not any(as_viewer["permissions"].values())
    as_member = client_for(member).get(f"/api/runs/{api_run.pk}").json()
    assert as_member["permissions"] == {
        "edit": True,
        "cancel": True,
        "resume": False,
        "fork": True,
        "share": True,
    }
