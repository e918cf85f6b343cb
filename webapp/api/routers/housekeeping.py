"""A run's housekeeping over the API, with the run page's rules (``webapp.runs.housekeeping``):
archive and restore (member), delete after naming the run again (admin). Renaming is
``PATCH /runs/{id}``.

``DELETE /runs/{id}`` is registered on the runs router (``webapp.api.routers.runs``), which holds
``GET`` and ``PATCH`` of that path: ninja answers one path from one router, and another router's
``DELETE`` there would never be reached (a 405)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Query, Router, Schema, Status

from webapp.api import serializers
from webapp.api.routers import WRITE, Id
from webapp.api.routers import runs as runs_routes
from webapp.api.schemas import ErrorOut
from webapp.runs import housekeeping
from webapp.teams.access import run_for

router = Router(tags=["runs"])

STATE: dict[int, Any] = {409: ErrorOut}


class ArchivedOut(Schema):
    id: int
    name: str
    archived_at: datetime | None = Field(description="When it was archived; null: listed as usual.")


class DeletedOut(Schema):
    id: int
    name: str
    metric_points: int
    samples: int
    log_lines: int
    checkpoints: int
    checkpoint_bytes: int
    share_links: int
    files: str = Field(
        description="What became of the run's directory: 'removed here' (the web app reaches the "
        "workers' runs directory) or 'sent to queue <q>' (a worker of the run's queue removes it)."
    )


CONFIRM = Query(..., min_length=1, max_length=400, description="The run's name, typed again.")


@router.post(
    "/runs/{run_id}/archive",
    response={200: ArchivedOut, **WRITE, **STATE},
    summary="Archive a finished run: hidden from the lists until restored (member)",
)
def archive_run(request: HttpRequest, run_id: Id) -> Status[dict[str, Any]]:
    run = run_for(request.auth, run_id, housekeeping.ACTION_ROLES["archive"])
    try:
        run = housekeeping.archive_run(run)
    except housekeeping.Refused as exc:
        return Status(409, {"detail": str(exc)})
    return Status(200, {"id": run.pk, "name": run.name, "archived_at": run.archived_at})


@router.post(
    "/runs/{run_id}/restore", response={200: ArchivedOut, **WRITE}, summary="Restore an archived run (member)"
)
def restore_run(request: HttpRequest, run_id: Id) -> dict[str, Any]:
    run = housekeeping.restore_run(run_for(request.auth, run_id, housekeeping.ACTION_ROLES["archive"]))
    return {"id": run.pk, "name": run.name, "archived_at": run.archived_at}


@runs_routes.router.delete(
    "/runs/{run_id}",
    response={200: DeletedOut, **WRITE, **STATE},
    summary="Delete a run with its metrics, samples, logs, checkpoints and files (admin)",
)
def delete_run(request: HttpRequest, run_id: Id, confirm: str = CONFIRM) -> Status[dict[str, Any]]:
    """``confirm`` must be the run's name. A queued or running run is a 409 (cancel it first)."""
    run = run_for(request.auth, run_id, housekeeping.ACTION_ROLES["delete"])
    try:
        purged = housekeeping.delete_run(run, confirm)
    except housekeeping.Refused as exc:
        if exc.field:
            raise serializers.query_error(exc.field, str(exc)) from None
        return Status(409, {"detail": str(exc)})
    return Status(200, {"id": purged.run_id, "name": purged.name, "files": purged.files, **vars(purged.held)})
