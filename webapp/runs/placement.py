"""Queue placement: which queue a run goes to, and why a queued run is still waiting.

Workers listen on queues named by what they have (``cpu``, ``gpu``, or a named pool) and keep
their capabilities in the worker registry (``jobs.registry``). A run's config implies what it
needs (``jobs.capabilities.requirements``: GPUs, backends). ``queue: auto`` picks the queue of
an online worker that has it; any queue may be named explicitly. A queued run that no online
worker can take keeps waiting in its queue (a worker that comes online later takes it), and
its status message says why (no worker online, none on that queue, or what each one lacks);
one that a worker can take says its place in the queue and what the queue's workers are busy
with ("2nd in queue 'cpu' (1 queued run ahead); worker vm is running demo-dapo (#1)"). Both are
refreshed by the web process every ``ROUTE_EVERY`` seconds (workers come and go), and at once
after every status change that can move a queue (``webapp.live.announce.status_changed``: a run
ahead started, finished or was cancelled), so an open page learns its new place without a poll.

External runs (``Run.origin``) have no queue and no worker: their script ships their events, so
none is placed, counted in a queue, or given waiting words here (``EXTERNAL_WAITING`` is theirs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db.models import Q

from engine.config import ConfigError
from jobs.capabilities import missing, requirements
from jobs.registry import WorkerEntry, registry_from_env
from webapp.live import announce
from webapp.runs.choices import RunOrigin, RunStatus
from webapp.runs.models import Run

log = logging.getLogger(__name__)

AUTO = "auto"
WAITING = "Waiting for a worker: "
EXTERNAL_WAITING = "waiting for its script to connect"
ROUTE_EVERY = 10.0
NAMED_PER_WORKER = 3
"""Runs named per busy worker in a waiting message; beyond them, how many more."""


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


def taken_by(host: str, *, external: bool = False, pid: int | None = None) -> str:
    """The status line of a run a worker just took, until the worker and the engine say more
    (``jobs.supervisor``, ``engine.phases``): the waiting message must not outlive the wait.
    An external run's script attached: where it reports from, until its own first status."""
    if external:
        return f"its script is reporting from {reporting_from(host, pid)}"
    return (
        f"worker {host} took the run: starting the engine"
        if host
        else "a worker took the run: starting the engine"
    )


def reporting_from(host: str, pid: int | None) -> str:
    """``gpu-7 (pid 123)``: where an external run's script runs, from its ingest ``attach``."""
    where = host or "an unnamed host"
    return f"{where} (pid {pid})" if pid else where


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass
class QueueView:
    """One queue as a waiting message reads it: its queued runs in start order, and the runs its
    workers are busy with. Read from the database, so it agrees with every status the pages show
    (the registry's own list of a worker's runs lags by a beat)."""

    queue: str
    queued: list[Run]
    active: list[Run]

    @classmethod
    def read(cls, queue: str, workers: list[WorkerEntry]) -> QueueView:
        queued = list(
            Run.objects.filter(status=RunStatus.QUEUED, queue=queue, origin=RunOrigin.ENGINE).order_by(
                "queued_at", "id"
            )
        )
        serving = [w for w in workers if queue in w.capabilities.queues]
        hosts = {w.capabilities.host for w in serving}
        ids = {int(r) for w in serving for r in w.running if r.isdigit()}
        active = (
            list(
                Run.objects.filter(
                    status__in=(RunStatus.STARTING, RunStatus.RUNNING), origin=RunOrigin.ENGINE
                )
                .filter(Q(worker_host__in=hosts) | Q(pk__in=ids))  # a script on a worker's machine is not its
                .only("id", "name", "worker_host")
                .order_by("started_at", "id")
            )
            if serving
            else []
        )
        return cls(queue, queued, active)

    def position(self, run: Run) -> int:
        """``run``'s place among the queue's queued runs (1: next), in the order claims respect
        (``reconcile.claim_order``: oldest first)."""
        return 1 + sum(1 for r in self.queued if (r.queued_at, r.pk) < (run.queued_at, run.pk))

    def busy_with(self, worker: WorkerEntry) -> list[Run]:
        return [
            r for r in self.active if str(r.pk) in worker.running or r.worker_host == worker.capabilities.host
        ]


def place_in_queue(run: Run, view: QueueView, able: list[WorkerEntry]) -> str:
    """Why a run that an online worker (``able``) can take still waits: its place in the queue,
    and what each of those workers is running."""
    position = view.position(run)
    ahead = position - 1
    where = (
        f"next in queue '{view.queue}'"
        if not ahead
        else f"{ordinal(position)} in queue '{view.queue}' ({ahead} queued run{'s' if ahead > 1 else ''} ahead)"
    )
    doing = []
    for worker in sorted(able, key=lambda w: w.capabilities.name):
        runs = view.busy_with(worker)
        named = ", ".join(f"{r.name} (#{r.pk})" for r in runs[:NAMED_PER_WORKER])
        more = f" and {len(runs) - NAMED_PER_WORKER} more" if len(runs) > NAMED_PER_WORKER else ""
        name = worker.capabilities.name
        doing.append(f"worker {name} is running {named}{more}" if runs else f"worker {name} is free")
    return WAITING + where + "; " + "; ".join(doing) + "."


def refresh_waiting(run: Run, workers: list[WorkerEntry], view: QueueView | None = None) -> bool:
    """Set a queued run's message to why it waits; True if it changed.

    ``view``: its queue, read once for all of its runs (``refresh_all_waiting``)."""
    if run.status != RunStatus.QUEUED or run.is_external:
        return False
    try:
        reason = waiting_reason(run.config, run.queue, workers)
        if not reason:
            able = able_workers(run.config, workers, run.queue)
            reason = place_in_queue(run, view or QueueView.read(run.queue, workers), able)
    except ConfigError as exc:
        # Stored by an older version whose config this one refuses: no worker will run it as it is.
        problems = "; ".join(f"{path}: {message}" for path, message in exc.problems)
        reason = (
            WAITING + f"none can run it: its config no longer validates ({problems}). Cancel it and fork it."
        )
    current = run.status_message or ""
    if reason == current:
        return False
    if current and not current.startswith(WAITING):
        return False  # a message someone else set (e.g. a cancel pending): leave it
    updated = Run.objects.filter(pk=run.pk, status=RunStatus.QUEUED, status_message=current).update(
        status_message=reason
    )
    if updated:
        run.status_message = reason
        # Its own words only: no other run's place moved (no queue refresh from it).
        announce.status_changed(run.pk, queue_moved=False)
    return bool(updated)


def refresh_all_waiting() -> int:
    """``refresh_waiting`` for every queued run, each queue read once; returns how many messages changed."""
    queues = set(
        Run.objects.filter(status=RunStatus.QUEUED, origin=RunOrigin.ENGINE)
        .values_list("queue", flat=True)
        .distinct()
    )
    if not queues:
        return 0
    workers = live_workers()
    changed = 0
    for queue in sorted(queues):
        view = QueueView.read(queue, workers)
        changed += sum(refresh_waiting(run, workers, view) for run in view.queued)
    return changed
