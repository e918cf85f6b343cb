"""Channels groups: their names, and sending to them (``webapp.live.announce`` says what).

- ``run.<id>``: browsers watching one run (events as they are stored, status changes).
- ``project.<id>``: browsers on a project's runs table (status changes of its runs).
- ``ingest.<id>``: the worker socket shipping one run (``cancel``).
- ``share.<link id>``, ``user.<id>``: browser sockets opened with a share link, or by a
  signed-in user: told to check their access again when it may have been taken away.

Only the web process sends to groups (ARCHITECTURE.md: the in-memory layer of embedded mode does not
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
    """``group_send`` from synchronous code (the on_commit callbacks of ``announce``)."""
    async_to_sync(send_async)(group, message)
