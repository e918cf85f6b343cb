"""The landing page: the caller's active and recent runs across their teams, then their teams and
projects.

The two lists of runs are one server-rendered fragment (``pages/_home_runs.html``), also served
alone (``home_runs``): the page's script (``static/tributary/home.js``) reads it again whenever
a run of the caller's projects changes status, so the server alone decides what is active and
what is recent, and a run that starts or ends moves between the lists without a reload.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.cache import patch_cache_control
from django.views.decorators.http import require_GET

from webapp.runs import selectors
from webapp.runs.choices import RunStatus
from webapp.runs.models import Run
from webapp.teams.access import memberships_of
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project

ACTIVE_LIMIT = 50
"""Active runs listed (newest first); beyond them the page links to the projects."""
RECENT_LIMIT = 10
"""Finished runs listed, the last to finish first."""
MAX_SOCKETS = 20
"""Project sockets the page opens at most; with more projects it reads the lists every
``POLL_SECONDS`` instead (a browser allows only so many sockets per site)."""
POLL_SECONDS = 15


def _total(run: Run) -> int | None:
    """The run's ``trainer.total_steps`` as ``selectors`` annotates it (JSON text), if a count."""
    try:
        total = int(run.total_steps)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return None
    return total if total > 0 else None


def _row(run: Run) -> dict[str, Any]:
    return {"run": run, "status": RunStatus(run.status), "total": _total(run)}


def _launch_project(memberships: list[Membership], projects: list[Project]) -> Project | None:
    """A project the caller may launch runs in (the first by team and name), for the empty state."""
    launchers = {m.team_id for m in memberships if Role(m.role).at_least(Role.MEMBER)}
    return next((p for p in projects if p.team_id in launchers), None)


def _projects(user: Any) -> list[Project]:
    return list(
        Project.objects.filter(team__memberships__user=user, archived_at=None)
        .select_related("team")
        .order_by("team__name", "name")
    )


def _runs_context(user: Any, memberships: list[Membership], projects: list[Project]) -> dict[str, Any]:
    active = selectors.active_runs_for(user, ACTIVE_LIMIT + 1)
    return {
        "active": [_row(r) for r in active[:ACTIVE_LIMIT]],
        "active_more": len(active) > ACTIVE_LIMIT,
        "recent": [_row(r) for r in selectors.recent_runs_for(user, RECENT_LIMIT)],
        "recent_limit": RECENT_LIMIT,
        "launch_project": _launch_project(memberships, projects),
        "has_projects": bool(projects),
    }


@login_required
@require_GET
def home(request: HttpRequest) -> HttpResponse:
    memberships = list(memberships_of(request.user))
    projects = _projects(request.user)
    by_team: dict[int, list[Project]] = {}
    for project in projects:
        by_team.setdefault(project.team_id, []).append(project)
    teams = [{"team": m.team, "role": m.role, "projects": by_team.get(m.team_id, [])} for m in memberships]
    followed = [p.pk for p in projects] if len(projects) <= MAX_SOCKETS else []
    context = {
        "teams": teams,
        "live": {"projects": followed, "poll_seconds": POLL_SECONDS if len(projects) > MAX_SOCKETS else 0},
        **_runs_context(request.user, memberships, projects),
    }
    return render(request, "pages/home.html", context)


@login_required
@require_GET
def home_runs(request: HttpRequest) -> HttpResponse:
    """The two lists alone, as the page shows them now (what ``home.js`` swaps in)."""
    memberships = list(memberships_of(request.user))
    context = _runs_context(request.user, memberships, _projects(request.user))
    response = render(request, "pages/_home_runs.html", context)
    patch_cache_control(response, no_store=True)
    return response
