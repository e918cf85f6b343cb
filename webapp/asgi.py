"""The ASGI application: Django over HTTP, the three sockets, and the lost-run sweeper.

The sweeper runs as a background task of each web process (ASGI lifespan, served by
uvicorn), so no extra process is needed in embedded mode and workers never need the
database. It waits ``LOST_AFTER`` seconds after start-up before its first sweep, so workers
that lost their socket while the web app was down get time to reconnect first. Beside it,
every ``ROUTE_EVERY`` seconds, queued runs' "waiting for a worker" messages are refreshed from
the worker registry (``webapp.runs.placement``), and every ``RECONCILE_EVERY`` seconds queued runs
whose broker message is gone (a Redis restarted without persistence) are sent again
(``webapp.runs.reconcile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

from django.core.asgi import get_asgi_application

django_http = get_asgi_application()

from channels.db import database_sync_to_async  # noqa: E402 - needs the app registry
from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from jobs.confine import make_undumpable  # noqa: E402
from webapp.live.routing import websocket_application  # noqa: E402
from webapp.runs.placement import ROUTE_EVERY, refresh_all_waiting  # noqa: E402
from webapp.runs.reconcile import reconcile_every, reconcile_queued_runs  # noqa: E402
from webapp.runs.sweeper import sweep_lost_runs  # noqa: E402

log = logging.getLogger(__name__)


async def _sweep_forever() -> None:
    await asyncio.sleep(settings.LOST_AFTER)
    while True:
        try:
            await database_sync_to_async(sweep_lost_runs)()
        except Exception:  # the database is down: try again next time
            log.exception("sweeping lost runs failed")
        await asyncio.sleep(settings.SWEEP_EVERY)


async def _route_forever() -> None:
    """Keep queued runs' "waiting for a worker" messages true as workers come and go."""
    while True:
        await asyncio.sleep(ROUTE_EVERY)
        try:
            await database_sync_to_async(refresh_all_waiting)()
        except Exception:
            log.exception("refreshing queued runs' messages failed")


async def _reconcile_forever(every: float) -> None:
    """The database is the truth of what is queued: re-send runs the broker lost."""
    while True:
        await asyncio.sleep(every)
        try:
            await database_sync_to_async(reconcile_queued_runs)()
        except Exception:  # the broker or the database is down: try again next time
            log.exception("reconciling queued runs with the broker failed")


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    tasks: list[asyncio.Task[None]] = []
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            # This process holds the secret key and database credentials: keep its memory and
            # environment out of the runs' reach (jobs/confine.py).
            make_undumpable()
            tasks = [
                asyncio.create_task(_sweep_forever()),
                asyncio.create_task(_route_forever()),
                asyncio.create_task(_reconcile_forever(reconcile_every())),  # a bad value fails start-up
            ]
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await send({"type": "lifespan.shutdown.complete"})
            return


application = ProtocolTypeRouter(
    {"http": django_http, "websocket": websocket_application(), "lifespan": lifespan}
)
