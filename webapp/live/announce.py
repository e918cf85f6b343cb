"""What the web app tells the live sockets, and when: always once the change is committed.

Every producer of a change a socket shows calls one function here (the services: ingest,
launch and cancel, the sweeper, queue placement, team membership, share links), so subscribers
never hear of a change the database does not hold yet, nor of one that was rolled back.
Outside a transaction ``on_commit`` runs at once. Callbacks run in the order they were
registered: a batch's status changes reach the run's watchers before the batch's events.

The messages and who receives them:

- ``run.status`` (``status_changed``): the run's watchers and its project's runs table.
- ``run.events`` (``events_stored``): the run's watchers; ``from_seq``..``last_seq`` says which
  seqs it carries, so a watcher that sees a hole reads the missing events from the database.
- ``access.check`` (``access_changed``): sockets opened with a share link or by a user, told to
  check again whether they may still see what they show.
- ``ingest.cancel`` (``cancel_requested``): the worker socket shipping the run.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from webapp.live.groups import ingest_group, project_group, run_group, send
from webapp.runs.models import Run
from webapp.runs.wording import status_words

ACCESS_CHECK = "access.check"


def status_message(run: Run) -> dict[str, Any]:
    """The ``run.status`` message for a run as stored now (also the browser socket's hello)."""
    return {
        "type": "run.status",
        "run": run.pk,
        "project": run.project_id,
        "status": str(run.status),
        "message": status_words(run.status_message),
        "last_step": run.last_step,
        "last_seq": run.last_seq,
        "worker_host": run.worker_host,
        "started_at": run.started_at.timestamp() if run.started_at else None,
        "finished_at": run.finished_at.timestamp() if run.finished_at else None,
    }


def _send_status(run_id: int) -> None:
    # Read after the commit: the message carries the run as committed (the cursor of the whole
    # batch, not the one the status event had), which a watcher catches up to on a final status.
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return
    message = status_message(run)
    send(run_group(run.pk), message)
    send(project_group(run.project_id), message)


def status_changed(run_id: int) -> None:
    """The run's status (or its status message) changed: tell its watchers and its project's
    runs table once that commits."""
    transaction.on_commit(lambda: _send_status(run_id))


def events_stored(run_id: int, previous_seq: int, last_seq: int, events: list[dict[str, Any]]) -> None:
    """Events ``previous_seq + 1``..``last_seq`` of the run were stored (``events`` as
    JSON-ready, validated): send them to the run's watchers once that commits."""
    message = {"type": "run.events", "from_seq": previous_seq + 1, "last_seq": last_seq, "events": events}
    transaction.on_commit(lambda: send(run_group(run_id), message))


def access_changed(group: str, why: str) -> None:
    """Access may have been taken away (a share link revoked, a member removed): the browser
    sockets in ``group`` ask the database again once that commits, and those that may no longer
    see what they show close with ``CLOSE_REVOKED`` (``webapp.live.consumers``), so the change
    reaches sockets already open, not only new connections."""
    transaction.on_commit(lambda: send(group, {"type": ACCESS_CHECK, "why": why}))


def cancel_requested(run_id: int, message: str) -> None:
    """A user asked to cancel a run that a worker holds: its ingest socket tells the worker."""
    transaction.on_commit(lambda: send(ingest_group(run_id), {"type": "ingest.cancel", "message": message}))
