"""Runs that stopped making progress become ``lost``.

A worker that dies (SIGKILL, power, network) cannot say so, and the broker does not
redeliver its task (kombu's filesystem transport loses a message taken by a killed worker
even with late acks). So the web app decides: a starting or running run that made no
progress for ``settings.LOST_AFTER`` seconds is marked lost, and can then be resumed from its
last checkpoint as a child run on any worker.

Progress is ``Run.heartbeat_at``: the last time one of the run's events was stored (the
engine writes a heartbeat event every ``logging.heartbeat_s`` seconds from its start,
through starter build and model loading, so a healthy run that is slowly preparing keeps
making progress) or the run was claimed by a worker. A worker's pings and reconnects are
liveness only (``Run.worker_seen_at``): a worker that keeps reconnecting while none of the
run's events get stored (a stuck engine, a batch the web app cannot take) no longer keeps
the run looking alive, and the lost message says which of the two happened.

One phase may have no events to count: while a run is ``starting``, its engine process is
importing Python, torch and its modules before its heartbeat thread exists (tens of seconds on
a loaded machine; the worker's own log lines about the launch may come first). There the
worker's liveness counts too, with room for its pings (``tributary.protocol.PING_INTERVAL_S``): a
starting run is lost when its worker has not been heard from for ``max(LOST_AFTER, 2 pings)``,
or when nothing of it was stored for ``STARTUP_LIMIT_FACTOR`` times ``LOST_AFTER``, however
alive the worker. A running run is judged on progress alone.

External runs (``Run.origin``) are never swept: no worker holds them, and their script keeps
its events on disk while the web app cannot hear it (offline first), shipping them later; a run
marked lost would refuse them. The run page says when it last heard from the script.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from tributary.protocol import PING_INTERVAL_S
from webapp.live import announce
from webapp.runs.choices import RunOrigin, RunStatus
from webapp.runs.models import InvalidTransition, Run

log = logging.getLogger(__name__)

STARTUP_LIMIT_FACTOR = 10  # an engine that writes no event for 10 x LOST_AFTER since its claim is lost


def _when(moment: datetime) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M:%S %Z")


def _preparing(run: Run) -> bool:
    """Claimed, and its engine not yet training (it may not have started its heartbeats)."""
    return run.status == RunStatus.STARTING


def lost_message(run: Run, now: datetime, limit: timedelta) -> str:
    """Why the run is lost, telling a silent worker from a connected one whose run is stuck."""
    since = _when(run.heartbeat_at) if run.heartbeat_at else "?"
    host = run.worker_host or "?"
    seconds = int(limit.total_seconds())
    if _preparing(run) and run.worker_seen_at is not None and run.worker_seen_at >= now - limit:
        return (
            f"worker {host} is still connected, but nothing of the starting run was stored since "
            f"{since}: its engine has written no event (limit {seconds * STARTUP_LIMIT_FACTOR} s while "
            f"starting); see the worker's log for the engine's output, then resume or launch it again"
        )
    if run.worker_seen_at is not None and run.worker_seen_at >= now - limit:
        return (
            f"no progress since {since} (limit {seconds} s): worker {host} is still connected "
            f"(last seen {_when(run.worker_seen_at)}) but no event of the run was stored, so its "
            f"engine is stuck or its events cannot be stored (see the Logs tab and the worker's "
            f"log): resume it from its last checkpoint"
        )
    return f"no word from worker {host} since {since} (limit {seconds} s): resume it from its last checkpoint"


def sweep_lost_runs(now: datetime | None = None, lost_after: float | None = None) -> list[int]:
    """Mark runs without progress lost; return their ids. Safe to run in several processes at once."""
    now = now or timezone.now()
    limit = timedelta(seconds=settings.LOST_AFTER if lost_after is None else lost_after)
    silent = Run.objects.filter(
        status__in=[RunStatus.STARTING, RunStatus.RUNNING],
        heartbeat_at__lt=now - limit,
        origin=RunOrigin.ENGINE,
    )
    # A worker waiting for its engine's first event pings every PING_INTERVAL_S: leave room for two.
    seen_limit = max(limit, timedelta(seconds=2 * PING_INTERVAL_S))
    lost: list[int] = []
    for run in silent:
        if _preparing(run):
            seen = max(run.heartbeat_at, run.worker_seen_at or run.heartbeat_at)
            if seen >= now - seen_limit and run.heartbeat_at >= now - limit * STARTUP_LIMIT_FACTOR:
                continue  # the engine is starting on a live worker
        message = lost_message(run, now, limit)
        try:
            run.mark_lost(message)
        except InvalidTransition:  # it finished, or another sweeper got it first
            continue
        announce.status_changed(run.pk)
        log.warning("run %s lost: %s", run.pk, message)
        lost.append(run.pk)
    return lost
