"""Teams, their projects, and a project's runs (list with filters, launch)."""

from __future__ import annotations

from typing import Any, Literal

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.http import HttpRequest
from django.utils.text import slugify
from ninja import Query, Router, Status
from ninja.errors import ValidationError

from webapp.api import serializers
from webapp.api.routers import AUTHED, READ, WRITE, Id
from webapp.api.schemas import (
    ProjectIn,
    ProjectOut,
    RunCreateIn,
    RunOut,
    RunPage,
    TeamDetailOut,
    TeamOut,
)
from webapp.inputs import BIGINT_MAX, parse_id
from webapp.runs import housekeeping as run_housekeeping
from webapp.runs import selectors
from webapp.runs.choices import RunStatus
from webapp.runs.models import Run
from webapp.runs.services import create_run
from webapp.teams import projects as team_projects
from webapp.teams.access import project_for, role_in, team_for
from webapp.teams.choices import Role
from webapp.teams.models import Project

router = Router(tags=["projects"])

STATUS = Query([], description="Any of these statuses (repeat: status=running&status=queued).")
TAG = Query([], description="Runs carrying all of these tags (repeatable).")
TEXT = Query("", max_length=200, description="Text in the run's name or notes (case-insensitive).")
CREATED_BY = Query("", description="'me', a user id, or a username.")
SORT = Query("-created_at", description="Order; '-' for descending. Ties: newest first.")
LIMIT = Query(50, ge=1, le=500)
ARCHIVED = Query(
    False, description="true: the archived ones instead of the listed ones, as the pages' Archived view."
)
OFFSET = Query(0, ge=0, le=BIGINT_MAX)

RunSort = Literal[
    "created_at", "-created_at", "name", "-name", "status", "-status", "last_step", "-last_step"
]


@router.get("/teams", response={200: list[TeamOut], **AUTHED}, summary="The caller's teams")
def list_teams(request: HttpRequest) -> list[dict[str, Any]]:
    return serializers.teams_out(request.auth)


@router.get("/teams/{team_id}", response={200: TeamDetailOut, **READ}, summary="A team and its members")
def get_team(request: HttpRequest, team_id: Id) -> dict[str, Any]:
    team = team_for(request.auth, team_id, Role.VIEWER)
    members = team.memberships.select_related("user").order_by("user__username")
    return {
        "id": team.pk,
        "name": team.name,
        "slug": team.slug,
        "role": role_in(request.auth, team.pk),
        "created_at": team.created_at,
        "members": [
            {"user_id": m.user_id, "username": m.user.get_username(), "role": m.role} for m in members
        ],
    }


@router.get(
    "/teams/{team_id}/projects",
    response={200: list[ProjectOut], **READ},
    summary="A team's projects (viewer)",
)
def list_projects(request: HttpRequest, team_id: Id, archived: bool = ARCHIVED) -> list[dict[str, Any]]:
    """The team's projects as its page lists them (archived ones with ``archived=true``)."""
    team = team_for(request.auth, team_id, Role.VIEWER)
    role = role_in(request.auth, team.pk)
    projects = list(
        (team_projects.archived if archived else team_projects.listed)(team).select_related("team")
    )
    counts = selectors.run_counts([p.pk for p in projects])
    return [serializers.project_out(p, role, counts) for p in projects]


@router.post(
    "/teams/{team_id}/projects", response={201: ProjectOut, **WRITE}, summary="Create a project (admin)"
)
def create_project(request: HttpRequest, team_id: Id, payload: ProjectIn) -> Status[dict[str, Any]]:
    team = team_for(request.auth, team_id, Role.ADMIN)
    slug = payload.slug or slugify(payload.name)[:100]
    if not slug:
        raise ValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ["body", "payload", "slug"],
                    "msg": "give a slug: the name has no letters or digits to make one from",
                }
            ]
        )
    try:
        with transaction.atomic():
            project = Project.objects.create(
                team=team, name=payload.name, slug=slug, description=payload.description
            )
    except IntegrityError:
        raise ValidationError(
            [
                {
                    "type": "unique",
                    "loc": ["body", "payload", "slug"],
                    "msg": f"the team already has a project {slug!r}: choose another slug",
                }
            ]
        ) from None
    return Status(201, serializers.project_out(project, role_in(request.auth, team.pk)))


@router.get("/projects/{project_id}", response={200: ProjectOut, **READ}, summary="A project (viewer)")
def get_project(request: HttpRequest, project_id: Id) -> dict[str, Any]:
    project = project_for(request.auth, project_id, Role.VIEWER)
    return serializers.project_out(project, role_in(request.auth, project.team_id))


@router.get(
    "/projects/{project_id}/runs", response={200: RunPage, **READ}, summary="A project's runs (viewer)"
)
def list_runs(
    request: HttpRequest,
    project_id: Id,
    status: list[RunStatus] = STATUS,
    tag: list[str] = TAG,
    q: str = TEXT,
    created_by: str = CREATED_BY,
    sort: RunSort = SORT,
    limit: int = LIMIT,
    offset: int = OFFSET,
    archived: bool = ARCHIVED,
) -> dict[str, Any]:
    """The project's runs as its runs table lists them: archived runs (unless queued or running
    again) only with ``archived=true``."""
    project = project_for(request.auth, project_id, Role.VIEWER)
    creator: Any | None = None
    if created_by:
        creator = _user_named(request, created_by)
    runs = Run.objects.filter(project=project).select_related("created_by")
    qs = selectors.filter_runs(
        run_housekeeping.archived(runs) if archived else run_housekeeping.listed(runs),
        statuses=[str(s) for s in status],
        tags=[t for t in tag if t],
        q=q.strip(),
        created_by=creator,
    )
    total = qs.count()
    items = qs.order_by(*selectors.RUN_SORTS[sort])[offset : offset + limit]
    return {
        "total": total,
        "limit": limit,
        "offset": offset,
        "items": [serializers.run_list_item(r) for r in items],
    }


def _user_named(request: HttpRequest, who: str) -> Any:
    """The user ``who`` names; a name nobody has matches no run (an empty page, not an error)."""
    if who == "me":
        return request.auth
    users = get_user_model().objects
    user_id = parse_id(who)
    user = users.filter(pk=user_id).first() if user_id is not None else users.filter(username=who).first()
    return user if user is not None else get_user_model()(pk=-1)


@router.post("/projects/{project_id}/runs", response={201: RunOut, **WRITE}, summary="Launch a run (member)")
def launch_run(request: HttpRequest, project_id: Id, payload: RunCreateIn) -> Status[dict[str, Any]]:
    """Validate the config with the engine's schema, store the run and queue it.

    A config that does not validate is a 422 naming each bad field
    (``loc: ["body", "payload", "config", "rollout", "n"]``); nothing is stored.
    """
    project = project_for(request.auth, project_id, Role.MEMBER)
    run = create_run(
        project,
        request.auth,
        payload.config,
        name=payload.name.strip(),
        queue=payload.queue,
        tags=payload.tags,
        notes=payload.notes,
    )
    return Status(201, serializers.run_out(run, role_in(request.auth, project.team_id)))
