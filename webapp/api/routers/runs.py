"""One run: read it, edit its name/tags/notes, cancel, resume, fork; its checkpoints, logs and output."""

from __future__ import annotations

from typing import Any

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Query, Router, Status
from ninja.errors import ValidationError

from webapp.api import serializers
from webapp.api.routers import READ, WRITE, Id
from webapp.api.schemas import (
    CheckpointOut,
    ErrorOut,
    ForkIn,
    LogPage,
    OutputPage,
    ResumeIn,
    RunOut,
    RunPatchIn,
)
from webapp.inputs import BIGINT_MAX
from webapp.runs.choices import LogLevel
from webapp.runs.models import Checkpoint, Run
from webapp.runs.output import full_log_response, output_page
from webapp.runs.services import RunConfigInvalid, fork_run, request_cancel, resume_run
from webapp.teams.access import role_in, run_for
from webapp.teams.choices import Role

router = Router(tags=["runs"])

STATE: dict[int, Any] = {409: ErrorOut}

AFTER_SEQ = Query(
    0, ge=0, le=BIGINT_MAX, description="Lines after this event seq (page on with next_after_seq)."
)
LEVEL = Query(None, description="Only lines at this level or a more severe one.")
LOG_LIMIT = Query(500, ge=1, le=5000)
AFTER_OFFSET = Query(
    -1,
    ge=-1,
    le=BIGINT_MAX,
    description="Lines starting after this byte of the full log (-1: from the first kept).",
)


def _out(request: HttpRequest, run: Run) -> dict[str, Any]:
    return serializers.run_out(run, role_in(request.auth, run.project.team_id))


@router.get("/runs/{run_id}", response={200: RunOut, **READ}, summary="A run (viewer)")
def get_run(request: HttpRequest, run_id: Id) -> dict[str, Any]:
    """Status, timestamps, worker, lineage, config, summary and what the caller may do."""
    return _out(request, run_for(request.auth, run_id, Role.VIEWER))


@router.patch(
    "/runs/{run_id}", response={200: RunOut, **WRITE}, summary="Rename, tag or annotate a run (member)"
)
def patch_run(request: HttpRequest, run_id: Id, payload: RunPatchIn) -> dict[str, Any]:
    """Only the fields given change (``name``, ``tags`` as the full new list, ``notes``)."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    changes = payload.model_dump(exclude_unset=True, exclude_none=True)
    if changes:
        Run.objects.filter(pk=run.pk).update(**changes)
    return _out(request, run)


@router.post(
    "/runs/{run_id}/cancel", response={200: RunOut, **WRITE, **STATE}, summary="Cancel a run (member)"
)
def cancel_run(request: HttpRequest, run_id: Id) -> dict[str, Any]:
    """A queued run is cancelled at once. A starting or running one keeps its status, with
    ``cancel_requested_at`` set, until its worker has stopped the engine (which then reports
    ``cancelled``). An external run's script is told (it ends the run with its own final
    status); cancelling it a second time ends it at once. A run already finished is a 409."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    username = request.auth.get_username()
    return _out(request, request_cancel(run, f"cancelled by {username}"))


@router.post(
    "/runs/{run_id}/resume",
    response={200: RunOut, **WRITE, **STATE},
    summary="Resume from a checkpoint (member)",
)
def resume_from_checkpoint(request: HttpRequest, run_id: Id, payload: ResumeIn) -> dict[str, Any]:
    """Queue the run again, as its next attempt, from a checkpoint (default: the latest): the same
    run continues, with the same id and one history (``attempts`` lists each attempt).

    A checkpoint older than the run's last step rewinds it: the steps after the checkpoint are
    logged again by the new attempt, and the points they replace are kept as superseded
    (``GET /runs/{id}/metrics/series?superseded=true``). The run must have stopped (409
    otherwise, when it has no checkpoint left to resume from, and for a checkpoint the engine
    deleted: ``deleted`` in ``GET /runs/{id}/checkpoints``)."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    checkpoint = None
    if payload.checkpoint_id is not None:
        checkpoint = Checkpoint.objects.filter(pk=payload.checkpoint_id, run=run).first()
        if checkpoint is None:
            raise ValidationError(
                [
                    {
                        "type": "value_error",
                        "loc": ["body", "payload", "checkpoint_id"],
                        "msg": f"run {run.pk} has no checkpoint {payload.checkpoint_id}: "
                        f"see GET /api/runs/{run.pk}/checkpoints",
                    }
                ]
            )
    return _out(request, resume_run(run, request.auth, checkpoint, queue=payload.queue))


@router.post(
    "/runs/{run_id}/fork",
    response={201: RunOut, **WRITE, **STATE},
    summary="Fork with config changes (member)",
)
def fork_with_changes(request: HttpRequest, run_id: Id, payload: ForkIn) -> Status[dict[str, Any]]:
    """A new run from this run's config with ``changes`` merged in, started from step 0.

    A merged config that does not validate is a 422 naming the fields under ``changes``; an
    external run (its config is its script's) is a 409."""
    parent = run_for(request.auth, run_id, Role.MEMBER)
    try:
        child = fork_run(
            parent, request.auth, payload.changes, name=payload.name.strip(), queue=payload.queue
        )
    except RunConfigInvalid as exc:
        # The parent's config was valid, so a problem comes from the changes: name them.
        raise RunConfigInvalid(
            [
                ("changes" + path.removeprefix("config"), msg) if path.startswith("config") else (path, msg)
                for path, msg in exc.problems
            ]
        ) from None
    return Status(201, _out(request, child))


@router.get(
    "/runs/{run_id}/checkpoints", response={200: list[CheckpointOut], **READ}, summary="A run's checkpoints"
)
def list_checkpoints(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    run = run_for(request.auth, run_id, Role.VIEWER)
    return [serializers.checkpoint_out(c) for c in run.checkpoints.order_by("step", "seq")]


@router.get("/runs/{run_id}/logs", response={200: LogPage, **READ}, summary="A run's log lines")
def list_logs(
    request: HttpRequest,
    run_id: Id,
    after_seq: int = AFTER_SEQ,
    level: LogLevel | None = LEVEL,
    limit: int = LOG_LIMIT,
) -> dict[str, Any]:
    run = run_for(request.auth, run_id, Role.VIEWER)
    return serializers.log_page(run, after_seq, level, limit)


@router.get(
    "/runs/{run_id}/output", response={200: OutputPage, **READ}, summary="A run's engine output lines"
)
def list_output(
    request: HttpRequest, run_id: Id, after: int = AFTER_OFFSET, limit: int = LOG_LIMIT
) -> dict[str, Any]:
    """The engine's own output (stderr and stdout of every rank, native libraries, progress), as
    the Logs tab shows it, oldest first; page on with ``next_after``. Only the newest lines are
    kept as lines (``dropped`` counts the rest); ``/output/full`` has every byte."""
    return output_page(run_for(request.auth, run_id, Role.VIEWER), after=after, limit=limit)


@router.get(
    "/runs/{run_id}/output/full",
    response=READ,
    summary="A run's full engine output (text download)",
    openapi_extra={
        "responses": {
            200: {"description": "engine.log", "content": {"text/plain": {"schema": {"type": "string"}}}}
        }
    },
)
def full_output(request: HttpRequest, run_id: Id) -> StreamingHttpResponse:
    """``engine.log`` as the web app holds it so far, streamed as ``text/plain`` (empty before the
    engine's first output)."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    return full_log_response(run, asynchronous=isinstance(request, ASGIRequest), missing_ok=True)
