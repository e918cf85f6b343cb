"""Who may see and do what: one place for the role checks of the API and both sockets.

Anything of a team the caller has no role in is reported as missing (404), never as
forbidden, so ids of other teams' runs and projects reveal nothing. A caller who can see
an object but lacks the role for an action gets ``Forbidden`` (403) naming the role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.db import models
from django.db.models import QuerySet

from webapp.runs.models import Run
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team

T = TypeVar("T", bound=models.Model)


class NotFound(Exception):
    """The object does not exist, or the caller may not know it does."""


class Forbidden(Exception):
    """The caller sees the object but lacks the role the action needs."""


def role_in(user: Any, team_id: int) -> Role | None:
    if not getattr(user, "is_authenticated", False):
        return None
    role = Membership.objects.filter(user=user, team_id=team_id).values_list("role", flat=True).first()
    return Role(role) if role else None


def _require(user: Any, team_id: int, role: Role | str, what: str) -> None:
    held = role_in(user, team_id)
    if held is None:
        raise NotFound(f"{what} not found")
    if not held.at_least(role):
        raise Forbidden(f"{what}: this needs the {Role(role).value} role in its team; you are {held.value}")


def memberships_of(user: Any) -> QuerySet[Membership]:
    """The caller's memberships with their teams, by team name (none for anonymous users)."""
    if not getattr(user, "is_authenticated", False):
        return Membership.objects.none()
    return Membership.objects.filter(user=user).select_related("team").order_by("team__name")


def _object_for(
    user: Any, objects: QuerySet[T], pk: int, role: Role | str, what: str, team_id: Callable[[T], int]
) -> T:
    """The ``what`` with primary key ``pk`` from ``objects``, if ``user`` holds ``role`` in its team
    (``team_id`` of it): a missing one and one of a team the user has no role in raise the same
    NotFound, a lower role Forbidden."""
    obj = objects.filter(pk=pk).first()
    if obj is None:
        raise NotFound(f"{what} {pk} not found")
    _require(user, team_id(obj), role, f"{what} {pk}")
    return obj


def team_for(user: Any, team_id: int, role: Role | str = Role.VIEWER) -> Team:
    return _object_for(user, Team.objects.all(), team_id, role, "team", lambda team: team.pk)


def project_for(user: Any, project_id: int, role: Role | str = Role.VIEWER) -> Project:
    projects = Project.objects.select_related("team")
    return _object_for(user, projects, project_id, role, "project", lambda project: project.team_id)


def run_for(user: Any, run_id: int, role: Role | str = Role.VIEWER) -> Run:
    runs = Run.objects.select_related("project__team")
    return _object_for(user, runs, run_id, role, "run", lambda run: run.project.team_id)
