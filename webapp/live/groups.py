"""Channels groups and the messages the web app sends to them.

- ``run.<id>``: browsers watching one run (events as they are stored, status changes).
- ``project.<id>``: browsers on a project's runs table (status changes of its runs).
- ``ingest.<id>``: the worker socket shipping one run (``cancel``).
- ``share.<link id>``, ``user.<id>``: browser sockets opened with a share link, or by a
  signed-in user: told to check their access again when it may have been taken away.

Only the web process sends to groups (DESIGN.md: the in-memory layer of embedded mode does not
cross processes). A send that fails (the Redis layer is down) is logged, never raised: the
database already holds the truth, and subscribers catch up from it.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


def project_group(project_id: int) -> str:
    return f"project.{project_id}"


def ingest_group(run_id: int) -> str:
    return f"ingest.{run_id}"


def share_group(link_id: int) -> str:
    """Browser sockets opened with one share link (closed when it is revoked)."""
    return f"share.{link_id}"


def user_group(user_id: int) -> str:
    """A signed-in user's browser sockets (re-checked when their team memberships change)."""
    return f"user.{user_id}"


async def send_async(group: str, message: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(group, message)
    except Exception:  # the layer's server is down: subscribers catch up from the database
        log.warning("could not send %s to group %s", message.get("type"), group, exc_info=True)


def send(group: str, message: dict[str, Any]) -> None:
    """``group_send`` from synchronous code (views, services, on_commit callbacks)."""
    async_to_sync(send_async)(group, message)


def status_message(run: Any) -> dict[str, Any]:
    """The ``run.status`` message for a run as stored now."""
    return {
        "type": "run.status",
        "run": run.pk,
        "project": run.project_id,
        "status": str(run.status),
        "message": run.status_message,
        "last_step": run.last_step,
        "last_seq": run.last_seq,
        "worker_host": run.worker_host,
        "started_at": run.started_at.timestamp() if run.started_at else None,
        "finished_at": run.finished_at.timestamp() if run.finished_at else None,
    }


def announce_status(run_id: int) -> None:
    """Tell the run's watchers and its project's runs table about the run's current status."""
    from webapp.runs.models import Run

    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return
    message = status_message(run)
    send(run_group(run.pk), message)
    send(project_group(run.project_id), message)


ACCESS_CHECK = "access.check"


def recheck_access_on_commit(group: str, why: str) -> None:
    """Once the current transaction commits (at once outside one), tell the browser sockets in
    ``group`` to check again whether they may still see what they show; those that may not
    close with ``CLOSE_REVOKED`` (``webapp.live.consumers``). Revoking a share link or removing
    a member thereby reaches sockets already open, not only new connections."""
    from django.db import transaction

    transaction.on_commit(lambda: send(group, {"type": ACCESS_CHECK, "why": why}))


def tell_worker_to_cancel(run_id: int, message: str) -> None:
    send(ingest_group(run_id), {"type": "ingest.cancel", "message": message})
