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
from urllib.parse import quote_plus

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import Count, Window
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from webapp.alerts import listing as alert_listing
from webapp.analysis import table
from webapp.analysis.models import TableView
from webapp.inputs import parse_ids
from webapp.pages.teams import columns, sparkline
from webapp.pages.teams.admin_context import admin_context
from webapp.pages.teams.forms import (
    DEFAULT_SORT,
    PAGE_SIZE,
    AddMemberForm,
    ProjectForm,
    RoleForm,
    RunFilterForm,
)
from webapp.pages.teams.rows import row_html
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
    """The table's query string with ``changes`` (``None`` drops a key; page 1 is left out).

    The chosen columns, group keys and column filters (``col``, ``group``, ``where``) are part of
    it, so the URL reproduces the view; ``group=[]`` given as a change is written as an empty
    ``group=``: the URL then says "not grouped" rather than "the saved view"."""
    merged = {**params, **changes}
    # Encoded as ``QueryDict.urlencode`` does (``quote_plus`` of each UTF-8 name and value, in
    # this order), without building a QueryDict: a page builds some 30 of these addresses.
    parts: list[str] = []
    for key in QUERY_KEYS:
        value = merged.get(key)
        if (
            value in (None, "", [], False)
            or (key == "sort" and value == DEFAULT_SORT)
            or (key == "page" and value == 1)
        ):
            if key == "group" and changes.get("group") == []:
                parts.append("group=")
            continue
        if isinstance(value, list):
            parts.extend(f"{key}={quote_plus(str(v))}" for v in value)
        elif value is True:
            parts.append(f"{key}=1")
        else:
            parts.append(f"{key}={quote_plus(str(value))}")
    return "?" + "&".join(parts)


QUERY_KEYS = (
    "status",
    "tag",
    "q",
    "archived",
    "col",
    "group",
    "where",
    "sort",
    "page",
    "fragment",
    "drop",
    "drop_group",
    "drop_where",
)
"""The table's query string's keys, in the order ``_query`` writes them."""


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


def _view_address(base: str, request: HttpRequest, state: table.TableState) -> str:
    """The request's address with the state's columns, groups and filters, actions left out."""
    query = request.GET.copy()
    for key in (*table.ACTION_KEYS, "page", "col", "group", "where"):
        query.pop(key, None)
    query.setlist("col", state.specs())
    if state.group_by:
        query.setlist("group", state.group_by)
    query.setlist("where", [w.text for w in state.wheres])
    return f"{base}?{query.urlencode()}"


def _table_state(
    request: HttpRequest, project: Project, runs: Any, errors: list[str]
) -> tuple[table.TableState, TableView | None, bool]:
    """The chosen columns, grouping and filters (``webapp.analysis.table``), checked against the
    project's runs; returns the state, the saved view and whether the URL is to be believed
    (False: a bad spec, the page answers 400 with ``errors``).

    A column the URL names that no run has is refused with its reason; one only the saved view
    names (its runs deleted since) is left out with a notice."""
    saved = TableView.objects.filter(user=request.user, project=project).first()
    try:
        state, stated = table.state_from_query(request.GET, saved)
    except table.TableSpecError as exc:
        errors.extend([str(exc), "Fix the column or filter in the address, or clear the filters."])
        return table.TableState(), saved, False
    missing = table.unknown(project.pk, runs, state)
    if missing and (stated or table.has_actions(request.GET)):
        errors.extend([f"{m}: check the spelling, or drop the column." for m in missing.values()])
        return table.TableState(), saved, False
    if missing:
        errors.append("Some saved columns were left out: " + "; ".join(missing.values()) + ".")
        state = table.without(state, missing)
    elif (stated or table.has_actions(request.GET)) and request.GET.get("fragment") != "group":
        table.save(request.user, project.pk, state, saved)
    return state, saved, True


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
    groups: list[dict[str, Any]] = []
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
    runs_of_project = Run.objects.filter(project=project)
    state, _saved, state_ok = _table_state(request, project, runs_of_project, errors)
    params.update(col=state.specs(), group=state.group_by, where=[w.text for w in state.wheres])
    fragment = request.GET.get("fragment") == "group"

    def query(**changes: Any) -> str:
        return base + _query(params, **changes)

    if state_ok and table.has_actions(request.GET) and not _is_htmx(request):
        return redirect(_view_address(base, request, state))  # the address of the view just chosen
    if (
        state_ok
        and not fragment
        and not _is_htmx(request)
        and (state.columns or state.group_by)
        and "col" not in request.GET
        and "group" not in request.GET
    ):
        # The saved view, written into the address: a copied link reproduces what is shown.
        return redirect(_view_address(base, request, state))
    grouping = bool(state.group_by) and not fragment
    if form.is_valid() and state_ok:
        params.update(form.cleaned_data)
        params["tag"] = params["tag"].strip()
        params["q"] = params["q"].strip()
        order = selectors.RUN_SORTS.get(params["sort"]) or table.sort_fields(state, params["sort"])
        if order is None:
            errors.append(
                f"sort: {params['sort'][:80]!r} is not a column of this table: click a column's "
                "header to sort by it."
            )
            errors.append("Fix the filter above or clear it.")
            http_status = 400
            order = selectors.RUN_SORTS[DEFAULT_SORT]
    else:
        for field, problems in form.errors.items():
            for problem in problems:
                errors.append(f"{field}: {problem}")
        if form.errors:
            errors.append("Fix the filter above or clear it.")
        http_status = 400
    if http_status == 200:
        try:
            # The chosen columns' cells come from ``table.cell_values``, read for the page's runs.
            runs = runs_of_project.select_related("created_by").defer("config", "notes")
            # Archived runs only on request (``archived=1``), and then only they.
            shown = housekeeping.archived if params["archived"] else housekeeping.listed
            qs = table.annotate(
                selectors.filter_runs(
                    shown(runs),
                    statuses=params["status"],
                    tags=[params["tag"]] if params["tag"] else [],
                    q=params["q"],
                    created_by=None,
                ),
                state,
                sort=None if grouping else params["sort"],
            )
            if grouping:
                page_obj = _page_of(table.grouped(qs, state, params["sort"]), params["page"], one_pass=True)
                groups = columns.group_rows(state, list(page_obj.object_list), query)
            else:
                page_obj = _page_of(qs.order_by(*order), params["page"], one_pass=bool(state.wheres))
                rows = run_rows(
                    list(page_obj.object_list), state, project, errors, brief=fragment, base=base
                )
        except DatabaseError:
            log.exception("runs table of project %s failed", project.pk)
            errors.append("The runs could not be loaded: the database did not answer. Try again in a moment.")
            http_status = 503
    filtered = bool(params["status"] or params["tag"] or params["q"] or params["archived"] or state.wheres)
    here = query(page=page_obj.number if page_obj is not None else None)
    context = {
        "project": project,
        "team": project.team,
        "role": role,
        "can_manage": can_manage and project.archived_at is None,
        "is_admin": role is not None and role.at_least(Role.ADMIN),
        "base": base,
        "rows": rows,
        "groups": groups,
        "grouping": grouping,
        "page": page_obj,
        "loaded": page_obj is not None,
        "params": params,
        "filtered": filtered,
        "errors": errors,
        "here": here,
        "here_query": here[len(base) + 1 :],
        "sort_links": _sort_links(base, params),
        "columns": columns.headers(state, query, params["sort"]),
        "state": state,
        "prev_url": query(page=page_obj.previous_page_number())
        if page_obj is not None and page_obj.has_previous()
        else "",
        "next_url": query(page=page_obj.next_page_number())
        if page_obj is not None and page_obj.has_next()
        else "",
        "statuses": [(s.value, s.label, s.value in params["status"]) for s in RunStatus],
        "status_meta": {s.value: {"label": s.label, "badge": s.badge} for s in RunStatus},
        "ungrouped_url": query(page=None, group=[]),
        "clear_url": query(status=None, tag=None, q=None, archived=None, where=None, page=None),
    }
    if fragment:
        template = "pages/teams/_group_runs.html"
    elif _is_htmx(request):
        template = "pages/teams/_runs_results.html"
    else:
        template = "pages/teams/project.html"
        context["where_choices"] = columns.where_choices(state)
        context["config_keys"], context["metric_names"] = table.catalog(project.pk, runs_of_project)
        context["drop_group_urls"] = [(g, query(page=None, drop_group=g)) for g in state.group_by]
        context["drop_where_urls"] = [(w.label, query(page=None, drop_where=w.text)) for w in state.wheres]
    response = render(request, template, context, status=http_status)
    patch_vary_headers(response, ["HX-Request"])
    return response


def _page_of(qs: Any, number: int, *, one_pass: bool) -> Page:
    """Page ``number`` of ``qs`` (as ``Paginator.get_page``: past the end, the last page).

    With ``one_pass`` the total comes from the page's own query (``COUNT(*) OVER ()``): a table
    filtered by config values and metric summaries then evaluates its filters once, not once to
    count and again for the page. Without filters a plain count is cheaper (an index-only count,
    and the page's rows read through the sort's index up to the limit)."""
    if not one_pass:
        return Paginator(qs, PAGE_SIZE).get_page(number)
    counted = qs.annotate(total_rows=Window(Count("*")))
    start = (number - 1) * PAGE_SIZE
    rows = list(counted[start : start + PAGE_SIZE])
    if rows:
        first = rows[0]
        total = first["total_rows"] if isinstance(first, dict) else first.total_rows
    else:
        total = qs.count() if number > 1 else 0
    paginator = Paginator([], PAGE_SIZE)
    paginator.count = total  # type: ignore[misc]  # a cached_property: the total is known
    if not rows and number > 1 and total:
        return _page_of(qs, paginator.num_pages, one_pass=True)
    return Page(rows, number if rows else 1, paginator)


def run_rows(
    runs: list[Run],
    state: table.TableState,
    project: Project,
    errors: list[str],
    *,
    brief: bool = False,
    base: str = "",
) -> list[dict[str, Any]]:
    """A page of runs as rows: fixed cells, sparklines, alert counts and the chosen columns, and
    each row's ``<tr>`` (``rows.row_html``; ``base``: the project's address, its tag links').
    ``brief``: a group's expanded list (``_group_runs.html``), which shows no trend, alert count
    or table row, so none is read or built."""
    ids = [r.pk for r in runs]
    sparks: dict[int, Any] = {}
    alert_counts: dict[int, int] = {}
    if not brief:
        try:
            sparks = sparkline.sparklines(ids, SPARK_METRIC)
        except DatabaseError:  # the table is still useful without its trends
            log.warning("sparklines of project %s failed", project.pk, exc_info=True)
            errors.append("The reward trends could not be loaded; the rest of the table is up to date.")
        alert_counts = alert_listing.counts_for(ids)
    values = table.cell_values(ids, state)
    now = timezone.now()
    rows = []
    for r in runs:
        row = {**_row(r, now, sparks), "alerts": alert_counts.get(r.pk, 0)}
        row["cells"] = cells = columns.run_cells(state, r, values)
        if not brief:
            row["cells_html"] = columns.cells_html(cells)
            row["html"] = row_html(row, base)
        rows.append(row)
    return rows


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
