"""The team page (members, roles, projects) and a project's runs table.

Who may see and do what comes from ``webapp.teams.access`` (anything of another team is a 404,
a missing role a 403); the runs are listed, filtered and sorted by ``webapp.runs.selectors`` (the
JSON API's own reads) and cancelled by ``webapp.runs.services.request_cancel``. Every form works
as a plain GET or POST; htmx swaps the runs table's results in place and posts the bulk cancel.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import DatabaseError, IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from webapp.alerts import listing as alert_listing
from webapp.inputs import parse_ids
from webapp.pages.teams import sparkline
from webapp.pages.teams.admin_context import admin_context
from webapp.pages.teams.forms import (
    DEFAULT_SORT,
    PAGE_SIZE,
    AddMemberForm,
    ProjectForm,
    RoleForm,
    RunFilterForm,
)
from webapp.runs import housekeeping, selectors
from webapp.runs.choices import ACTIVE_STATUSES, RunStatus
from webapp.runs.models import InvalidTransition, Run
from webapp.runs.services import request_cancel
from webapp.runs.wording import status_words
from webapp.teams import access
from webapp.teams import projects as team_projects
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team
from webapp.teams.services import remove_member, set_role

log = logging.getLogger(__name__)

SPARK_METRIC = "reward/mean"
ACCURACY_METRICS = ("eval/accuracy", "train/accuracy")
ENTROPY_METRIC = "actor/entropy"
MAX_BULK = 500


# --- access ------------------------------------------------------------------------------


@contextmanager
def _http_errors() -> Iterator[None]:
    """The access checks' NotFound and Forbidden as Django's 404 and 403 pages."""
    try:
        yield
    except access.NotFound as exc:
        raise Http404(str(exc)) from None
    except access.Forbidden as exc:
        raise PermissionDenied(str(exc)) from None


def team_or_error(request: HttpRequest, team_id: int, role: Role = Role.VIEWER) -> Team:
    """The team if the caller holds ``role`` in it: else the 404 (outsider) or 403 page; shared
    with the team pages of ``manage``."""
    with _http_errors():
        return access.team_for(request.user, team_id, role)


def project_or_error(request: HttpRequest, project_id: int, role: Role = Role.VIEWER) -> Project:
    """As ``team_or_error``, for a project (by its team's role)."""
    with _http_errors():
        return access.project_for(request.user, project_id, role)


def _is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true" and not request.headers.get(
        "HX-History-Restore-Request"
    )


# --- the team page -------------------------------------------------------------------------


def team_context(request: HttpRequest, team: Team, **forms: Any) -> dict[str, Any]:
    role = access.role_in(request.user, team.pk)
    members = list(team.memberships.select_related("user").order_by("user__username"))
    admins = sum(1 for m in members if m.role == Role.ADMIN)
    projects = list(team_projects.listed(team))
    counts = selectors.run_counts([p.pk for p in projects])
    active = {s.value for s in ACTIVE_STATUSES}
    return {
        "team": team,
        "role": role,
        "is_admin": role is not None and role.at_least(Role.ADMIN),
        "members": [
            {
                "membership": m,
                "user": m.user,
                "role": Role(m.role),
                "is_you": m.user_id == request.user.pk,
                "last_admin": m.role == Role.ADMIN and admins <= 1,
            }
            for m in members
        ],
        "roles": Role.choices,
        "projects": [
            {
                "project": p,
                "total": sum(counts[p.pk].values()),
                "active": sum(n for s, n in counts[p.pk].items() if s in active),
            }
            for p in projects
        ],
        "add_form": forms.get("add_form") or AddMemberForm(team=team),
        "project_form": forms.get("project_form") or ProjectForm(team=team),
        "archived_count": team_projects.archived(team).count(),
        **(admin_context(request, team, **forms) if role == Role.ADMIN else {}),
    }


@never_cache  # an admin's page may show a new invite link, once
@login_required
@require_GET
def team_page(request: HttpRequest, team_id: int) -> HttpResponse:
    team = team_or_error(request, team_id)
    return render(request, "pages/teams/team.html", team_context(request, team))


@login_required
@require_POST
def member_add(request: HttpRequest, team_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    form = AddMemberForm(request.POST, team=team)
    if not form.is_valid():
        return render(
            request, "pages/teams/team.html", team_context(request, team, add_form=form), status=400
        )
    set_role(team, form.user, form.cleaned_data["role"])
    messages.success(
        request, f"{form.user.get_username()} joined {team.name} as {form.cleaned_data['role']}."
    )
    return redirect("team", team_id=team.pk)


class LastAdmin(Exception):
    pass


def _change(team: Team, user_id: int, new_role: Role | None) -> Membership:
    """Set (or with None remove) a member's role; refuses to leave the team without an admin."""
    with transaction.atomic():
        # Lock the team's admin rows so two admins demoting each other cannot both succeed.
        admin_ids = list(
            Membership.objects.select_for_update()
            .filter(team=team, role=Role.ADMIN)
            .values_list("user_id", flat=True)
        )
        membership = Membership.objects.select_related("user").filter(team=team, user_id=user_id).first()
        if membership is None:
            raise Http404(f"user {user_id} is not in team {team.pk}")
        if membership.role == Role.ADMIN and new_role != Role.ADMIN and len(admin_ids) <= 1:
            raise LastAdmin(
                f"{membership.user.get_username()} is the team's last admin: make someone else admin first."
            )
        if new_role is None:
            remove_member(membership)
        else:
            membership.role = new_role
            membership.save(update_fields=["role"])
    return membership


@login_required
@require_POST
def member_role(request: HttpRequest, team_id: int, user_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Choose a role: {', '.join(Role.values)}.")
        return redirect("team", team_id=team.pk)
    try:
        membership = _change(team, user_id, Role(form.cleaned_data["role"]))
    except LastAdmin as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{membership.user.get_username()} is now {membership.role}.")
    return redirect("team", team_id=team.pk)


@login_required
@require_POST
def member_remove(request: HttpRequest, team_id: int, user_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    try:
        membership = _change(team, user_id, None)
    except LastAdmin as exc:
        messages.error(request, str(exc))
        return redirect("team", team_id=team.pk)
    messages.success(request, f"{membership.user.get_username()} was removed from {team.name}.")
    if membership.user_id == request.user.pk:
        return redirect("home")
    return redirect("team", team_id=team.pk)


@login_required
@require_POST
def project_create(request: HttpRequest, team_id: int) -> HttpResponse:
    team = team_or_error(request, team_id, Role.ADMIN)
    form = ProjectForm(request.POST, team=team)
    if form.is_valid():
        data = form.cleaned_data
        try:
            with transaction.atomic():
                project = Project.objects.create(
                    team=team, name=data["name"], slug=data["slug"], description=data["description"].strip()
                )
        except IntegrityError:  # created by someone else in between
            form.add_error("slug", f"The team already has a project {data['slug']!r}: choose another slug.")
        else:
            messages.success(request, f"Project {project.name} created.")
            return redirect("project", project_id=project.pk)
    return render(
        request, "pages/teams/team.html", team_context(request, team, project_form=form), status=400
    )


# --- the runs table ------------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def _metric(summary: dict[str, Any], *names: str) -> tuple[str, float] | None:
    for name in names:
        value = summary.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name, float(value)
    return None


def _row(run: Run, now: Any, sparks: dict[int, Any]) -> dict[str, Any]:
    status = RunStatus(run.status)
    active = status in ACTIVE_STATUSES
    duration = None
    if run.started_at:
        end = run.finished_at or (now if active else None)
        if end is not None:
            duration = (end - run.started_at).total_seconds()
    summary = run.summary if isinstance(run.summary, dict) else {}
    return {
        "run": run,
        "status": status,
        "message": status_words(run.status_message),
        "active": active,
        "duration": format_duration(duration),
        "started_ts": run.started_at.timestamp() if run.started_at else "",
        "finished_ts": run.finished_at.timestamp() if run.finished_at else "",
        "reward": _metric(summary, SPARK_METRIC),
        "accuracy": _metric(summary, *ACCURACY_METRICS),
        "entropy": _metric(summary, ENTROPY_METRIC),
        "spark": sparks.get(run.pk, ""),
    }


def _query(params: dict[str, Any], **changes: Any) -> str:
    """The table's query string with ``changes`` (``None`` drops a key; page 1 is left out)."""
    merged = {**params, **changes}
    qd = QueryDict(mutable=True)
    for key in ("status", "tag", "q", "archived", "sort", "page"):
        value = merged.get(key)
        if (
            value in (None, "", [], False)
            or (key == "sort" and value == DEFAULT_SORT)
            or (key == "page" and value == 1)
        ):
            continue
        if isinstance(value, list):
            qd.setlist(key, [str(v) for v in value])
        elif value is True:
            qd[key] = "1"
        else:
            qd[key] = str(value)
    encoded = qd.urlencode()
    return f"?{encoded}" if encoded else "?"


SORTABLE = {"name": "name", "status": "status", "created_at": "created_at", "last_step": "last_step"}


def _sort_links(base: str, params: dict[str, Any]) -> dict[str, dict[str, str]]:
    current = params["sort"]
    links = {}
    for column, key in SORTABLE.items():
        if current == key:
            direction, next_sort = "ascending", f"-{key}"
        elif current == f"-{key}":
            direction, next_sort = "descending", key
        else:
            # Names read best A..Z first; dates and steps newest/highest first.
            direction, next_sort = "none", key if key in ("name", "status") else f"-{key}"
        links[column] = {"url": base + _query(params, sort=next_sort, page=None), "aria": direction}
    return links


@login_required
@require_GET
def project_page(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_or_error(request, project_id)
    role = access.role_in(request.user, project.team_id)
    can_manage = role is not None and role.at_least(Role.MEMBER)
    base = project.get_absolute_url()
    form = RunFilterForm(request.GET)
    errors: list[str] = []
    rows: list[dict[str, Any]] = []
    page_obj = None
    params: dict[str, Any] = {
        "status": [],
        "tag": "",
        "q": "",
        "archived": False,
        "sort": DEFAULT_SORT,
        "page": 1,
    }
    http_status = 200
    if form.is_valid():
        params.update(form.cleaned_data)
        params["tag"] = params["tag"].strip()
        params["q"] = params["q"].strip()
        try:
            runs_of_project = (
                Run.objects.filter(project=project).select_related("created_by").defer("config", "notes")
            )
            # Archived runs only on request (``archived=1``), and then only they.
            shown = housekeeping.archived if params["archived"] else housekeeping.listed
            qs = selectors.filter_runs(
                shown(runs_of_project),
                statuses=params["status"],
                tags=[params["tag"]] if params["tag"] else [],
                q=params["q"],
                created_by=None,
            ).order_by(*selectors.RUN_SORTS[params["sort"]])
            page_obj = Paginator(qs, PAGE_SIZE).get_page(params["page"])
            runs = list(page_obj.object_list)
            try:
                sparks = sparkline.sparklines([r.pk for r in runs], SPARK_METRIC)
            except DatabaseError:  # the table is still useful without its trends
                log.warning("sparklines of project %s failed", project.pk, exc_info=True)
                sparks = {}
                errors.append("The reward trends could not be loaded; the rest of the table is up to date.")
            now = timezone.now()
            alert_counts = alert_listing.counts_for([r.pk for r in runs])
            rows = [{**_row(r, now, sparks), "alerts": alert_counts.get(r.pk, 0)} for r in runs]
        except DatabaseError:
            log.exception("runs table of project %s failed", project.pk)
            errors.append("The runs could not be loaded: the database did not answer. Try again in a moment.")
            http_status = 503
    else:
        for field, problems in form.errors.items():
            for problem in problems:
                errors.append(f"{field}: {problem}")
        errors.append("Fix the filter above or clear it.")
        http_status = 400
    filtered = bool(params["status"] or params["tag"] or params["q"] or params["archived"])
    here = base + _query(params, page=page_obj.number if page_obj is not None else None)
    context = {
        "project": project,
        "team": project.team,
        "role": role,
        "can_manage": can_manage and project.archived_at is None,
        "is_admin": role is not None and role.at_least(Role.ADMIN),
        "base": base,
        "rows": rows,
        "page": page_obj,
        "loaded": page_obj is not None,
        "params": params,
        "filtered": filtered,
        "errors": errors,
        "here": here,
        "here_query": here[len(base) + 1 :],
        "sort_links": _sort_links(base, params),
        "prev_url": base + _query(params, page=page_obj.previous_page_number())
        if page_obj is not None and page_obj.has_previous()
        else "",
        "next_url": base + _query(params, page=page_obj.next_page_number())
        if page_obj is not None and page_obj.has_next()
        else "",
        "statuses": [(s.value, s.label, s.value in params["status"]) for s in RunStatus],
        "status_meta": {s.value: {"label": s.label, "badge": s.badge} for s in RunStatus},
        "clear_url": base + _query({"sort": params["sort"]}),
    }
    template = "pages/teams/_runs_results.html" if _is_htmx(request) else "pages/teams/project.html"
    response = render(request, template, context, status=http_status)
    patch_vary_headers(response, ["HX-Request"])
    return response


def _selected_ids(request: HttpRequest) -> tuple[list[int], list[str]]:
    """The run ids ticked in the table (a form's ``runs`` fields, or the query's) and the bad parts."""
    return parse_ids(request.POST.getlist("runs") or request.GET.getlist("runs"))


def _back(project: Project, request: HttpRequest) -> str:
    """Back to the table with its filters (only a query string is taken from the form)."""
    query = request.POST.get("return_query", "").lstrip("?")
    return project.get_absolute_url() + (f"?{query}" if query and "\n" not in query else "")


@login_required
@require_POST
def runs_cancel(request: HttpRequest, project_id: int) -> HttpResponse:
    """Cancel the selected runs of the project (member); one result line per run."""
    project = project_or_error(request, project_id, Role.MEMBER)
    ids, bad = _selected_ids(request)
    results: list[dict[str, Any]] = [
        {"run_id": None, "name": part, "ok": False, "message": "is not a run id"} for part in bad[:20]
    ]
    if len(ids) > MAX_BULK:
        results.append({"run_id": None, "name": "", "ok": False,
                        "message": f"select at most {MAX_BULK} runs at a time"})  # fmt: skip
        ids = []
    runs = {r.pk: r for r in Run.objects.filter(project=project, pk__in=ids)}
    who = request.user.get_username()
    for run_id in ids:
        run = runs.get(run_id)
        if run is None:
            results.append({"run_id": run_id, "name": f"#{run_id}", "ok": False,
                            "message": "not found in this project"})  # fmt: skip
            continue
        try:
            run = request_cancel(run, f"cancelled by {who}")
        except InvalidTransition:
            run.refresh_from_db(fields=["status"])
            message, ok = f"already {run.status}: nothing to cancel", False
        else:
            ok = True
            message = (
                "cancelled"
                if run.status == RunStatus.CANCELLED
                else "cancel requested: its worker is stopping it"
            )
        results.append({"run_id": run.pk, "name": run.name, "ok": ok, "message": message})
    if not ids and not results:
        results.append(
            {"run_id": None, "name": "", "ok": False, "message": "Select the runs to cancel first."}
        )
    if _is_htmx(request):
        response = render(request, "pages/teams/_bulk_result.html", {"results": results})
        response["HX-Trigger"] = "runs-changed"
        return response
    for r in results:
        text = f"{r['name']}: {r['message']}" if r["name"] else r["message"]
        (messages.success if r["ok"] else messages.error)(request, text)
    return redirect(_back(project, request))


@login_required
@require_http_methods(["GET", "POST"])
def runs_compare(request: HttpRequest, project_id: int) -> HttpResponse:
    """The Compare button without JavaScript: on to ``/compare/?runs=1,2,3``."""
    project = project_or_error(request, project_id)
    ids, _bad = _selected_ids(request)
    if not ids:
        messages.error(request, "Select two or more runs to compare.")
        return redirect(_back(project, request))
    return redirect(f"{reverse('compare')}?runs={','.join(str(i) for i in ids)}")
