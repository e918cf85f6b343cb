"""Runs whose worker went silent become ``lost``.

A worker that dies (SIGKILL, power, network) cannot say so, and the broker does not
redeliver its task (kombu's filesystem transport loses a message taken by a killed worker
even with late acks). So the web app decides: a starting or running run not heard from for
``settings.LOST_AFTER`` seconds (no event, no ping) is marked lost, and can then be resumed
from its last checkpoint as a child run on any worker.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from webapp.runs.choices import RunStatus
from webapp.runs.models import InvalidTransition, Run

log = logging.getLogger(__name__)


def sweep_lost_runs(now: datetime | None = None, lost_after: float | None = None) -> list[int]:
    """Mark silent runs lost; return their ids. Safe to run in several processes at once."""
    now = now or timezone.now()
    limit = timedelta(seconds=settings.LOST_AFTER if lost_after is None else lost_after)
    silent = Run.objects.filter(
        status__in=[RunStatus.STARTING, RunStatus.RUNNING], heartbeat_at__lt=now - limit
    )
    lost: list[int] = []
    for run in silent:
        since = timezone.localtime(run.heartbeat_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        try:
            run.mark_lost(
                f"no word from worker {run.worker_host or '?'} since {since} "
                f"(limit {int(limit.total_seconds())} s): resume it from its last checkpoint"
            )
        except InvalidTransition:  # it finished, or another sweeper got it first
            continue
        log.warning("run %s lost: worker %s silent since %s", run.pk, run.worker_host, since)
        lost.append(run.pk)
    return lost
