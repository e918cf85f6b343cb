"""The run page, its actions, the share page and the compare page.

Reads go through ``webapp.runs.selectors`` (the reads the JSON API makes too), the run itself in
the API's shape (``webapp.api.serializers``, which the page's scripts read), and who-may-do-what
through ``webapp.teams.access``; the actions call ``webapp.runs.services``. Charts load their data from
the JSON API and the run socket (``run.js``), so the pages render only the frame around them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from webapp.alerts import listing as alerts
from webapp.api import serializers
from webapp.api.schemas import clean_tags
from webapp.inputs import parse_id
from webapp.pages.rollouts.views import rollouts_query
from webapp.pages.runs.display import config_yaml, page_data
from webapp.pages.runs.logs import log_view
from webapp.runs import external, housekeeping, selectors
from webapp.runs.choices import RunStatus
from webapp.runs.models import Checkpoint, InvalidTransition, Run, ShareLink
from webapp.runs.services import CannotResume, ProjectArchived, RunConfigInvalid, request_cancel, resume_run
from webapp.runs.sharing import revoke_share_link, shared_run_or_404
from webapp.teams.access import Forbidden, NotFound, role_in, run_for
from webapp.teams.choices import Role


def _visible(request: HttpRequest, run_id: int, role: Role = Role.VIEWER) -> Run:
    """The run, or a 404 (not there / not the caller's team); ``Forbidden`` goes up as is."""
    try:
        return run_for(request.user, run_id, role)
    except NotFound as exc:
        raise Http404(str(exc)) from None


def _member_action(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A POST that acts on a run and needs the member role: logged in, 404 for outsiders, 403 for
    viewers; ``view`` gets the run in place of the URL's ``run_id``."""

    @login_required
    @require_POST
    @functools.wraps(view)
    def action(request: HttpRequest, run_id: int, **kwargs: Any) -> HttpResponse:
        try:
            run = _visible(request, run_id, Role.MEMBER)
        except Forbidden as exc:
            raise PermissionDenied(str(exc)) from None
        return view(request, run, **kwargs)

    return action


def _is_htmx(request: HttpRequest) -> bool:
    return request.headers.get("HX-Request") == "true"


# --- the run page ------------------------------------------------------------------------


def _header_context(run: Run, role: Role | None, token: str = "") -> dict[str, Any]:
    """What the header (``_header.html``) shows: the run as the API has it, the actions its
    state allows (``permissions``) and the status line. The page and the header fragment that
    replaces it after each status change render from this one place."""
    detail = serializers.run_out(run, role)
    shared = bool(token)
    checkpoints = [serializers.checkpoint_out(c) for c in run.checkpoints.order_by("step", "seq")]
    resumable = [serializers.checkpoint_out(c) for c in selectors.resumable_checkpoints(run)]
    total_steps = (detail["config"].get("trainer") or {}).get("total_steps")
    return {
        "run": detail,
        "shared": shared,
        "token": token,
        "perms": detail["permissions"],
        "can_act": not shared and detail["permissions"]["edit"],
        "total_steps": total_steps,
        # The status line counts the steps of a training run itself (from ``last_step``, which
        # run.js follows live), so the status message never has to.
        "show_step": detail["status"] == RunStatus.RUNNING and bool(total_steps),
        "checkpoints": checkpoints,
        "resumable": resumable,
        "attempts": detail["attempts"],
        "base_path": reverse("share", kwargs={"token": token}) if shared else run.get_absolute_url(),
        # Rename, archive, restore, delete: what the caller's role and the run's state allow.
        "manage": {} if shared else housekeeping.actions_for(run, role),
        "archived_at": run.archived_at,
        # An external run: where its script reports from (no worker, no queue).
        "external": external.banner(run) if run.is_external else "",
    }


def _render_run(request: HttpRequest, run: Run, role: Role | None, token: str = "") -> HttpResponse:
    context = _header_context(run, role, token)
    detail, shared = context["run"], context["shared"]
    context.update(
        {
            "config_yaml": config_yaml(detail["config"]),
            "logs": None if shared else log_view(run),
            "shares": [] if shared or not detail["permissions"]["share"] else _shares(run),
            "tags_value": ", ".join(detail["tags"]),
            "notes_value": detail["notes"],
            "page_data": page_data(detail, selectors.metric_name_list(run), token),
            "has_superseded": selectors.has_superseded_points(run),
            "alerts": alerts.for_run(run.pk),
            # The rollout view the page URL names (?rollouts=..., kept there by rollouts.js).
            "rollouts_query": rollouts_query(request.GET.get("rollouts", "")),
        }
    )
    context["page_data"]["alerts"] = [
        {k: v for k, v in a.items() if k != "created_at"} for a in context["alerts"]
    ]
    context["page_data"]["alert_titles"] = alerts.TITLES
    return render(request, "pages/runs/run.html", context)


def _render_header(
    request: HttpRequest, run: Run, role: Role | None, token: str = "", action_error: str = ""
) -> HttpResponse:
    context = {**_header_context(run, role, token), "action_error": action_error, "fragment": True}
    response = render(request, "pages/runs/_header.html", context)
    response["Cache-Control"] = "no-store"  # always the state as it is now
    return response


@login_required
@require_GET
def run_page(request: HttpRequest, run_id: int) -> HttpResponse:
    run = _visible(request, run_id)
    return _render_run(request, run, role_in(request.user, run.project.team_id))


@login_required
@require_GET
def run_header(request: HttpRequest, run_id: int) -> HttpResponse:
    """The run page's header as a fragment, for the swap after a status change."""
    run = _visible(request, run_id)
    return _render_header(request, run, role_in(request.user, run.project.team_id))


@require_GET
def share_page(request: HttpRequest, token: str) -> HttpResponse:
    """The run page read-only, for whoever holds a live token (no login)."""
    run = shared_run_or_404(token)
    return _render_run(request, run, None, token)


@require_GET
def share_header(request: HttpRequest, token: str) -> HttpResponse:
    run = shared_run_or_404(token)
    return _render_header(request, run, None, token)


def _config_download(run: Run) -> JsonResponse:
    response = JsonResponse(run.config, json_dumps_params={"indent": 2})
    response["Content-Disposition"] = f'attachment; filename="run-{run.pk}-config.json"'
    return response


@login_required
@require_GET
def run_config_json(request: HttpRequest, run_id: int) -> HttpResponse:
    return _config_download(_visible(request, run_id))


@require_GET
def share_config_json(request: HttpRequest, token: str) -> HttpResponse:
    run = shared_run_or_404(token)
    return _config_download(run)


# --- actions (members) -------------------------------------------------------------------


@_member_action
def run_cancel(request: HttpRequest, run: Run) -> HttpResponse:
    """Through htmx the answer is the fresh header, swapped in place (the charts and their zoom
    stay); a plain form post is redirected to the page with a message."""
    error = ""
    asked_before = run.cancel_requested_at is not None
    try:
        request_cancel(run, f"cancelled by {request.user.get_username()}")
    except InvalidTransition:
        error = f"This run is already {run.status}: there is nothing to cancel."
    if _is_htmx(request):
        return _render_header(request, run, role_in(request.user, run.project.team_id), action_error=error)
    if error:
        messages.error(request, error)
    else:
        messages.success(request, _cancel_words(run, asked_before))
    return redirect(run)


def _cancel_words(run: Run, asked_before: bool) -> str:
    if run.status != RunStatus.CANCELLED:
        if run.is_external:
            return "Cancel requested: its script is told to stop (run.should_stop())."
        return "Cancel requested: the worker stops the run and saves a checkpoint."
    if run.is_external and asked_before:
        return "Ended here: its script had not stopped."
    return "Cancelled before it started."


@_member_action
def run_resume(request: HttpRequest, run: Run) -> HttpResponse:
    """The same run continues as its next attempt. Through htmx the answer is the fresh header,
    swapped in place like Cancel's (the page, its charts and its socket stay: the chart goes on
    from the checkpoint's step); a plain form post is redirected to the page with a message."""
    checkpoint = None
    error = ""
    raw = (request.POST.get("checkpoint") or "").strip()
    if raw and raw != "latest":
        checkpoint = Checkpoint.objects.filter(pk=parse_id(raw) or -1, run=run).first()
        if checkpoint is None:
            error = f"Run {run.pk} has no checkpoint {raw[:40]}: choose one from the list."
    if not error:
        try:
            run = resume_run(run, request.user, checkpoint)
        except (CannotResume, ProjectArchived, RunConfigInvalid) as exc:
            error = f"Cannot resume: {exc}"
    if _is_htmx(request):
        return _render_header(request, run, role_in(request.user, run.project.team_id), action_error=error)
    if error:
        messages.error(request, error)
    else:
        messages.success(
            request, f"Resumed: attempt {run.attempt_number} starts from step {run.resume_from.step}."
        )
    return redirect(run)


@_member_action
def run_meta(request: HttpRequest, run: Run) -> HttpResponse:
    """Tags and notes (htmx swaps the returned fragment; a plain post is redirected)."""
    error = ""
    tags_text = request.POST.get("tags", "")
    notes = request.POST.get("notes", run.notes)
    try:
        tags = clean_tags([t for t in tags_text.split(",") if t.strip()])
        if len(notes) > 100_000:
            raise ValueError("notes: at most 100000 characters")
    except ValueError as exc:
        error = f"tags: {exc}" if not str(exc).startswith("notes") else str(exc)
    else:
        Run.objects.filter(pk=run.pk).update(tags=tags, notes=notes)
        run.refresh_from_db()
    if not _is_htmx(request):
        if error:
            messages.error(request, error)
        return redirect(run)
    context = {
        "run": {"id": run.pk, "tags": run.tags, "notes": run.notes},
        "can_act": True,
        "meta_error": error,
        "tags_value": tags_text if error else ", ".join(run.tags),
        "notes_value": notes if error else run.notes,
        "saved": not error,
    }
    return render(request, "pages/runs/_meta.html", context, status=422 if error else 200)


def _shares(run: Run) -> list[dict[str, Any]]:
    return [serializers.share_out(s) for s in selectors.share_links(run)]


def _shares_fragment(request: HttpRequest, run: Run, status: int = 200) -> HttpResponse:
    return render(
        request, "pages/runs/_shares.html", {"run": {"id": run.pk}, "shares": _shares(run)}, status=status
    )


@_member_action
def share_create(request: HttpRequest, run: Run) -> HttpResponse:
    ShareLink.create(run, request.user)
    if not _is_htmx(request):
        return redirect(f"{run.get_absolute_url()}#shares")
    return _shares_fragment(request, run)


@_member_action
def share_revoke(request: HttpRequest, run: Run, share_id: int) -> HttpResponse:
    if not revoke_share_link(run, share_id):  # open sockets of the link close too
        raise Http404(f"run {run.pk} has no share link {share_id}")
    if not _is_htmx(request):
        return redirect(f"{run.get_absolute_url()}#shares")
    return _shares_fragment(request, run)
