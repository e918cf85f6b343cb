"""What the web app tells the live sockets, and when: always once the change is committed.

Every producer of a change a socket shows calls one function here (the services: ingest,
launch and cancel, the sweeper, queue placement, team membership, share links), so subscribers
never hear of a change the database does not hold yet, nor of one that was rolled back.
Outside a transaction ``on_commit`` runs at once. Callbacks run in the order they were
registered: a batch's status changes reach the run's watchers before the batch's events.

The messages and who receives them:

- ``run.status`` (``status_changed``): the run's watchers and its project's runs table.
- ``run.progress`` (``batch_stored``): the run's project's lists (the landing page's active runs),
  the run's stored step, at most once a second per run (``webapp.live.throttle``).
- ``run.events`` (``batch_stored``): the run's watchers; ``from_seq``..``last_seq`` says which
  seqs it carries, so a watcher that sees a hole reads the missing events from the database.
  The ingest socket sends these two itself, from its event loop, once ``store_events`` returned
  (committed) and it acked the worker; every other caller of ``store_events`` through
  ``on_commit``. Either way after the batch's status changes and alerts, announced at its commit.
- ``access.check`` (``access_changed``): sockets opened with a share link or by a user, told to
  check again whether they may still see what they show.
- ``ingest.cancel`` (``cancel_requested``): the worker socket shipping the run.
- ``run.output`` (``output_stored``): the run's watchers (not share links: the Logs tab is the
  team's); lines of the engine's output, by byte offset, which a page that missed some reads again.
- ``run.alert`` (``alerts_fired``): the run's watchers and its project's runs table; health alerts
  that fired (``webapp.alerts``), which a page that missed them reads from the API.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django.db import transaction

from webapp.live.groups import ingest_group, project_group, run_group, send, send_async
from webapp.live.throttle import Throttle
from webapp.runs.models import Run
from webapp.runs.wording import status_words

if TYPE_CHECKING:
    from webapp.runs.ingest import Stored

log = logging.getLogger(__name__)

ACCESS_CHECK = "access.check"
STEP_EVERY_S = 1.0
"""Seconds between two ``run.progress`` messages of one run (what the channel layer can carry for
hundreds of runs stepping many times a second)."""
_steps = Throttle(STEP_EVERY_S, send_async)


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


def status_changed(run_id: int, *, queue_moved: bool = True) -> None:
    """The run's status (or its status message) changed: tell its watchers and its project's
    runs table once that commits.

    ``queue_moved``: the change may move other runs' places in the queues (a run started,
    finished, was cancelled or queued again): the queued runs' waiting messages ("2nd in queue
    'cpu'; worker vm is running demo-dapo (#1)", ``webapp.runs.placement``) are refreshed then
    too, and each that changes is announced to its own watchers. False for a change of words
    alone (a preparing run's phase, a waiting message itself), which moves no queue."""
    transaction.on_commit(lambda: _send_status(run_id))
    if queue_moved:
        transaction.on_commit(_refresh_queues)


def _refresh_queues() -> None:
    # Imported here: placement announces the messages it changes, through this module.
    from webapp.runs.placement import refresh_all_waiting

    try:
        refresh_all_waiting()
    except Exception:  # the database or the registry is down: the periodic refresh catches up
        log.warning("refreshing queued runs' waiting messages failed", exc_info=True)


async def batch_stored(stored: Stored) -> None:
    """A batch of the engine's events is stored and committed (``webapp.runs.ingest.store_events``):
    events ``previous_seq + 1``..``last_seq`` (as JSON-ready, validated) to the run's watchers,
    and the run's step, when the batch moved it, to its project's lists (throttled per run; the
    latest step of a burst is sent when the run's window closes).

    Awaited on the web server's event loop: by the ingest socket after its ack, or through
    ``batch_stored_sync``. One consumer stores and announces a run's batches one at a time, so
    they go out in order; two sockets of one run (a worker reconnecting) may announce out of
    order, which a watcher handles as it handles a dropped message (``RunConsumer``)."""
    if stored.last_seq > stored.previous_seq:
        message = {
            "type": "run.events",
            "from_seq": stored.previous_seq + 1,
            "last_seq": stored.last_seq,
            "events": stored.events,
        }
        await send_async(run_group(stored.run_id), message)
    if stored.step is not None:
        progress = {
            "type": "run.progress",
            "run": stored.run_id,
            "project": stored.project_id,
            "last_step": stored.step,
        }
        await _steps.offer(stored.run_id, stored.step, project_group(stored.project_id), progress)


def batch_stored_sync(stored: Stored) -> None:
    """``batch_stored`` from synchronous code, once the transaction commits (at once outside one):
    one hop to the event loop for both messages."""
    transaction.on_commit(lambda: async_to_sync(batch_stored)(stored))


def output_stored(run_id: int, lines: list[dict[str, Any]], skipped: int = 0) -> None:
    """Lines of the run's engine output were stored (``webapp.runs.output``; ``skipped`` older
    ones of the same burst left out): tell its watchers once that commits."""
    message = {"type": "run.output", "lines": lines, "skipped": skipped}
    transaction.on_commit(lambda: send(run_group(run_id), message))


def alerts_fired(run_id: int, project_id: int, alerts: list[dict[str, Any]]) -> None:
    """Health alerts fired on the run (``webapp.alerts.monitor``): its watchers (a toast, the
    chart marks) and its project's runs table (the row's count) hear of them once they commit."""
    message = {"type": "run.alert", "run": run_id, "project": project_id, "alerts": alerts}

    def send_both() -> None:
        send(run_group(run_id), message)
        send(project_group(project_id), message)

    transaction.on_commit(send_both)


def access_changed(group: str, why: str) -> None:
    """Access may have been taken away (a share link revoked, a member removed): the browser
    sockets in ``group`` ask the database again once that commits, and those that may no longer
    see what they show close with ``CLOSE_REVOKED`` (``webapp.live.consumers``), so the change
    reaches sockets already open, not only new connections."""
    transaction.on_commit(lambda: send(group, {"type": ACCESS_CHECK, "why": why}))


def cancel_requested(run_id: int, message: str) -> None:
    """A user asked to cancel a run that a worker holds: its ingest socket tells the worker."""
    transaction.on_commit(lambda: send(ingest_group(run_id), {"type": "ingest.cancel", "message": message}))
