"""Self-service teams: a new team (anyone signed in, who becomes its admin), and what a team's
admins do without Django's admin: rename the team, make and revoke invite links, rename,
archive and restore projects.

Who may do what comes from ``webapp.teams.access`` through the team pages' own helpers (an
outsider gets a 404, a lower role a 403 naming the role needed). Every form is a plain POST and
a redirect; a refused one renders its page again with the error at the field (status 400).
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from webapp.pages.teams.admin_context import remember_new_link
from webapp.pages.teams.forms import InviteForm, ProjectNameForm, TeamNameForm
from webapp.pages.teams.views import project_or_error, team_context, team_or_error
from webapp.teams import invites
from webapp.teams import projects as team_projects
from webapp.teams.choices import Role
from webapp.teams.services import create_team, rename_team

# --- teams -----------------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def team_new(request: HttpRequest) -> HttpResponse:
    form = TeamNameForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        name = form.cleaned_data["name"]
        try:
            with transaction.atomic():
                team = create_team(name, request.user)
        except IntegrityError:  # another team took the same slug a moment ago: one more try
            team = create_team(name, request.user)
        messages.success(request, f"Team {team.name} created: you are its admin. Invite people below.")
        return redirect("team", team_id=team.pk)
    status = 400 if request.method == "POST" else 200
    return render(request, "pages/teams/team_new.html", {"form": form}, status=status)


@login_required
@require_POST
def team_rename(request: HttpRequest, team_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    form = TeamNameForm(request.POST)
    if not form.is_valid():
        context = team_context(request, team, name_form=form)
        return render(request, "pages/teams/team.html", context, status=400)
    old = team.name
    rename_team(team, form.cleaned_data["name"])
    messages.success(request, f"{old} is now called {team.name}.")
    return redirect("team", team_id=team.pk)


# --- invites ---------------------------------------------------------------------------------


@login_required
@require_POST
def invite_create(request: HttpRequest, team_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    form = InviteForm(request.POST)
    if not form.is_valid():
        context = team_context(request, team, invite_form=form)
        return render(request, "pages/teams/team.html", context, status=400)
    data = form.cleaned_data
    invite, token = invites.create_invite(team, request.user, data["role"], data["note"], data["days"])
    remember_new_link(request, invite, token)
    return redirect(f"{team.get_absolute_url()}#invites")


@login_required
@require_POST
def invite_revoke(request: HttpRequest, team_id: int, invite_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    invite = invites.revoke_invite(team, invite_id)
    if invite is None:
        raise Http404(f"team {team.pk} has no pending invite {invite_id}")
    who = f" for {invite.note}" if invite.note else ""
    messages.success(request, f"The invite{who} was revoked: its link no longer works.")
    return redirect(f"{team.get_absolute_url()}#invites")


# --- projects --------------------------------------------------------------------------------


@login_required
@require_GET
def archived_projects(request: HttpRequest, team_id: int) -> HttpResponse:
    """The team's archived projects, each with a Restore button for its admins."""
    team = team_or_error(request, team_id)
    context = team_context(request, team)
    context["archived"] = list(team_projects.archived(team))
    return render(request, "pages/teams/archived_projects.html", context)


@login_required
@require_POST
def project_rename(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_or_error(request, project_id, Role.ADMIN)
    form = ProjectNameForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Project name: {' '.join(form.errors['name'])}")
        return redirect(project)
    old = project.name
    team_projects.rename_project(project, form.cleaned_data["name"])
    messages.success(request, f"Project {old} is now called {project.name}.")
    return redirect(project)


@login_required
@require_POST
def project_archive(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_or_error(request, project_id, Role.ADMIN)
    try:
        team_projects.archive_project(project)
    except team_projects.ProjectRefused as exc:
        messages.error(request, str(exc))
        return redirect(project)
    messages.success(
        request, f"Project {project.name} was archived: find it under Archived projects to restore it."
    )
    return redirect("team", team_id=project.team_id)


@login_required
@require_POST
def project_restore(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_or_error(request, project_id, Role.ADMIN)
    team_projects.restore_project(project)
    messages.success(request, f"Project {project.name} was restored.")
    return redirect(project)
