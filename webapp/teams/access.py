"""Who may see and do what: one place for the role checks of the API and both sockets.

Anything of a team the caller has no role in is reported as missing (404), never as
forbidden, so ids of other teams' runs and projects reveal nothing. A caller who can see
an object but lacks the role for an action gets ``Forbidden`` (403) naming the role.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from webapp.runs.models import Run
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team


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


def team_for(user: Any, team_id: int, role: Role | str = Role.VIEWER) -> Team:
    team = Team.objects.filter(pk=team_id).first()
    if team is None:
        raise NotFound(f"team {team_id} not found")
    _require(user, team.pk, role, f"team {team_id}")
    return team


def project_for(user: Any, project_id: int, role: Role | str = Role.VIEWER) -> Project:
    project = Project.objects.select_related("team").filter(pk=project_id).first()
    if project is None:
        raise NotFound(f"project {project_id} not found")
    _require(user, project.team_id, role, f"project {project_id}")
    return project


def run_for(user: Any, run_id: int, role: Role | str = Role.VIEWER) -> Run:
    run = Run.objects.select_related("project__team").filter(pk=run_id).first()
    if run is None:
        raise NotFound(f"run {run_id} not found")
    _require(user, run.project.team_id, role, f"run {run_id}")
    return run
