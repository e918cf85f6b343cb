"""The landing page: the caller's teams and their projects."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from webapp.teams.access import memberships_of
from webapp.teams.models import Project


@login_required
def home(request: HttpRequest) -> HttpResponse:
    memberships = memberships_of(request.user)
    projects = Project.objects.filter(team__memberships__user=request.user).select_related("team").order_by("name")
    by_team: dict[int, list[Project]] = {}
    for project in projects:
        by_team.setdefault(project.team_id, []).append(project)
    teams = [{"team": m.team, "role": m.role, "projects": by_team.get(m.team_id, [])} for m in memberships]
    return render(request, "pages/home.html", {"teams": teams})
