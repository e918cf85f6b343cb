"""A run's housekeeping from its page: rename inline (members), archive and restore (members),
delete after typing the run's name again (admins). The rules and the purge are
``webapp.runs.housekeeping``; these views check the role (404 for outsiders, 403 naming the role
needed) and answer in the page's terms.

Renaming through htmx answers the title block alone (``_title.html``), error included (at the
field, naming it), so the rest of the page stays as it is; a plain form post is redirected with
a message. Archive and restore are plain posts back to the page. Deleting has a page of its
own that lists what goes (rows and files) before anything does.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from webapp.runs import housekeeping
from webapp.runs.choices import ACTIVE_STATUSES, RunStatus
from webapp.runs.models import Run
from webapp.teams.access import Forbidden, NotFound, role_in, run_for


def _run(request: HttpRequest, run_id: int, action: str) -> Run:
    """The run, if the caller's role in its team allows ``action`` (see ``ACTION_ROLES``)."""
    try:
        return run_for(request.user, run_id, housekeeping.ACTION_ROLES[action])
    except NotFound as exc:
        raise Http404(str(exc)) from None
    except Forbidden as exc:
        raise PermissionDenied(str(exc)) from None


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


@login_required
@require_POST
def run_rename(request: HttpRequest, run_id: int) -> HttpResponse:
    run = _run(request, run_id, "rename")
    raw = request.POST.get("name", "")
    error = ""
    try:
        housekeeping.rename_run(run, raw)
    except housekeeping.Refused as exc:
        error = str(exc)
    if not _is_htmx(request):
        if error:
            messages.error(request, error)
        else:
            messages.success(request, f"Renamed to {run.name}.")
        return redirect(run)
    context: dict[str, Any] = {
        "run": {"id": run.pk, "name": run.name},
        "manage": {"rename": True},
        "rename_error": error,
        "rename_value": raw if error else run.name,
        "renamed": not error,
    }
    # 200 with the error in the block: htmx swaps only 2xx answers, and the field must show it.
    response = render(request, "pages/runs/_title.html", context)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def run_archive(request: HttpRequest, run_id: int) -> HttpResponse:
    run = _run(request, run_id, "archive")
    try:
        housekeeping.archive_run(run)
    except housekeeping.Refused as exc:
        messages.error(request, str(exc))
    else:
        messages.success(
            request,
            f"{run.name} was archived: hidden from the runs table and the landing page. Restore it here.",
        )
    return redirect(run)


@login_required
@require_POST
def run_restore(request: HttpRequest, run_id: int) -> HttpResponse:
    run = _run(request, run_id, "archive")
    housekeeping.restore_run(run)
    messages.success(request, f"{run.name} was restored: the runs table shows it again.")
    return redirect(run)


@login_required
@require_http_methods(["GET", "POST"])
def run_delete(request: HttpRequest, run_id: int) -> HttpResponse:
    """GET: what deleting removes and the name to type; POST: delete, then back to the project."""
    run = _run(request, run_id, "delete")
    error, field, status = "", "", 200
    if request.method == "POST":
        try:
            purged = housekeeping.delete_run(run, request.POST.get("confirm", ""))
        except housekeeping.Refused as exc:
            error, field = str(exc), exc.field
            status = 400 if field else 409
            run = Run.objects.select_related("project__team").filter(pk=run.pk).first() or run
        else:
            held = purged.held
            files = (
                "its files were removed"
                if purged.files == "removed here"
                else "no worker held files of it (an external run)"
                if run.is_external
                else f"a worker of queue {run.queue} removes its files"
            )
            messages.success(
                request,
                f"Run {purged.name} was deleted with its {_n(held.metric_points, 'metric point')}, "
                f"{_n(held.samples, 'sample')}, {_n(held.log_lines, 'log line')} and "
                f"{_n(held.checkpoints, 'checkpoint')}; {files}.",
            )
            return redirect(run.project)
    active = RunStatus(run.status) in ACTIVE_STATUSES
    context = {
        "run": run,
        "held": housekeeping.holdings(run),
        "active": active,
        "error": error,
        "error_field": field,
        "typed": request.POST.get("confirm", "") if field else "",
        "role": role_in(request.user, run.project.team_id),
    }
    return render(request, "pages/runs/delete.html", context, status=status)
