"""Queue placement: which queue a run goes to, and why a queued run is still waiting.

Workers listen on queues named by what they have (``cpu``, ``gpu``, or a named pool) and keep
their capabilities in the worker registry (``jobs.registry``). A run's config implies what it
needs (``jobs.capabilities.requirements``: GPUs, backends). ``queue: auto`` picks the queue of
an online worker that has it; any queue may be named explicitly. A queued run that no online
worker can take keeps waiting in its queue (a worker that comes online later takes it), and
its status message says why (no worker online, none on that queue, or what each one lacks),
refreshed by the web process every ``ROUTE_EVERY`` seconds.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.config import ConfigError
from jobs.capabilities import missing, requirements
from jobs.registry import WorkerEntry, registry_from_env
from webapp.live import announce
from webapp.runs.choices import RunStatus
from webapp.runs.models import Run

log = logging.getLogger(__name__)

AUTO = "auto"
WAITING = "Waiting for a worker: "
ROUTE_EVERY = 10.0


def live_workers() -> list[WorkerEntry]:
    """The workers whose registry entry is fresh; empty (and logged) when the registry is unreachable."""
    try:
        return registry_from_env().workers()
    except Exception as exc:
        log.warning("worker registry unreachable: %s", exc)
        return []


def able_workers(
    config: dict[str, Any], workers: list[WorkerEntry], queue: str | None = None
) -> list[WorkerEntry]:
    need = requirements(config)
    return [
        w
        for w in workers
        if (queue is None or queue in w.capabilities.queues) and not missing(w.capabilities, need)
    ]


def resolve_queue(queue: str, config: dict[str, Any], workers: list[WorkerEntry]) -> str:
    """``auto``: the queue of an online worker that can run ``config`` (the least busy one,
    its first queue); with none online, ``gpu`` for a run that needs GPUs, else ``cpu``."""
    if queue != AUTO:
        return queue
    able = sorted(able_workers(config, workers), key=lambda w: (len(w.running), w.capabilities.name))
    if able and able[0].capabilities.queues:
        queues = able[0].capabilities.queues
        preferred = "gpu" if requirements(config).gpus and "gpu" in queues else queues[0]
        return preferred
    return "gpu" if requirements(config).gpus else "cpu"


def waiting_reason(config: dict[str, Any], queue: str, workers: list[WorkerEntry]) -> str:
    """Why no online worker can take a run on ``queue`` now; ``""`` when one can."""
    need = requirements(config)
    if not workers:
        return (
            WAITING + f"none is online. The run starts when a worker serving queue '{queue}' connects "
            "(the Workers page says how to start one)."
        )
    on_queue = [w for w in workers if queue in w.capabilities.queues]
    if not on_queue:
        served = sorted({q for w in workers for q in w.capabilities.queues})
        return (
            WAITING + f"no online worker serves queue '{queue}' (served: {', '.join(served) or 'none'}). "
            f"Start one for '{queue}' (the Workers page says how), or launch the run on another queue."
        )
    lacking = [(w, missing(w.capabilities, need)) for w in on_queue]
    if all(reasons for _, reasons in lacking):
        detail = "; ".join(f"{w.capabilities.name}: {', '.join(reasons)}" for w, reasons in lacking)
        return WAITING + f"no worker on queue '{queue}' has what the run needs ({need.describe()}): {detail}."
    return ""


def refresh_waiting(run: Run, workers: list[WorkerEntry]) -> bool:
    """Set a queued run's message to why it waits (or clear an old one); True if it changed."""
    if run.status != RunStatus.QUEUED:
        return False
    try:
        reason = waiting_reason(run.config, run.queue, workers)
    except ConfigError as exc:
        # Stored by an older version whose config this one refuses: no worker will run it as it is.
        problems = "; ".join(f"{path}: {message}" for path, message in exc.problems)
        reason = WAITING + f"none can run it: its config no longer validates ({problems}). Cancel it and fork it."
    current = run.status_message or ""
    if reason == current or (not reason and not current.startswith(WAITING)):
        return False
    if current and not current.startswith(WAITING):
        return False  # a message someone else set (e.g. a cancel pending): leave it
    updated = Run.objects.filter(pk=run.pk, status=RunStatus.QUEUED, status_message=current).update(
        status_message=reason
    )
    if updated:
        run.status_message = reason
        announce.status_changed(run.pk)
    return bool(updated)


def refresh_all_waiting() -> int:
    """``refresh_waiting`` for every queued run; returns how many messages changed."""
    workers = live_workers()
    return sum(refresh_waiting(run, workers) for run in Run.objects.filter(status=RunStatus.QUEUED))
