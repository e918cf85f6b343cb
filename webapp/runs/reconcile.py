"""Queued runs whose broker message is gone are sent again, in the order they were queued.

The database, not the broker, is the truth of what is queued. A Redis broker restarted without
persistence forgets every message it held, so a ``queued`` run would wait forever with nothing
left to deliver it. The reconciler compares the two: a queued run with no message of its own in
the broker (neither waiting in its queue nor delivered to a worker that has not acknowledged it)
is an orphan, and is sent again with ``queueing.queue_run``, oldest first.

How a message is found (the broker's own layout, read from kombu's transports):

- Redis (``kombu.transport.redis``): a queue is a Redis list named after it, plus one list per
  priority step (``<queue>\\x06\\x16<pri>``); a message a worker received and has not acknowledged
  yet (the run is starting, or waits there for a GPU as an ETA retry) is in the ``unacked`` hash
  until the task ends (``task_acks_late``). Each message's body names the run (``run_id``). This
  view is exact, but for the instant between a worker's BRPOP and its write to ``unacked``: a run
  is re-sent only if it is missing from two views taken a moment apart.
- Filesystem (embedded mode, ``kombu.transport.filesystem``): a waiting message is a file in the
  broker folder, and survives any restart. A message a worker took is a file no more, so an
  orphan cannot be told from a run that a worker holds: nothing is ever re-sent there.

Order. A re-sent message goes to the back of its queue, behind runs launched after the restart
and before the reconciler noticed. So the claim (``claim_order``, asked by the ingest socket when
a supervisor attaches to a queued run) refuses to start a run while an older queued run of its
queue is orphaned (it is re-sent first) or waits in the queue behind it; the refused run is sent
again, behind the older ones, and its supervisor ends without starting anything. A run a worker
holds (delivered, not acknowledged) never blocks a newer one: it may wait there for a GPU.

Never twice. A re-send of a message that was not lost (or a broker redelivery) leaves two
messages for one run; the exclusive claim (``webapp.live.consumers._claim``) lets one supervisor
start the engine and ends the other's task.

External runs (``Run.origin``) are never sent: their script, not a worker, trains them, so they
have no message to lose, and they never stand in an engine run's queue order.

Concurrency. Every pass holds a process lock and, on PostgreSQL, a transaction-scoped advisory
lock, so web replicas reconciling at once re-send a run once (the second sees the first's
message). A run committed within ``SEND_GRACE_S`` is skipped: ``create_run`` publishes its message
only after the transaction commits, so for that instant it has none yet.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from django.db import connection, transaction
from django.utils import timezone

from jobs.app import SUPERVISE_TASK, broker_folder, broker_settings
from webapp.runs.choices import RunOrigin, RunStatus
from webapp.runs.models import Run
from webapp.runs.queueing import queue_run

log = logging.getLogger(__name__)

RECONCILE_EVERY_ENV = "RECONCILE_EVERY"
SEND_GRACE_S = 10.0
CONFIRM_PAUSE_S = 0.3
ADVISORY_LOCK_KEY = 0x7472_6962_7571  # "tribuq": one key for every reconciling web process
REDIS_PRIORITY_SEP = "\x06\x16"  # kombu.transport.redis.Channel.sep
REDIS_PRIORITY_STEPS = (0, 3, 6, 9)  # kombu.transport.redis.PRIORITY_STEPS
REDIS_UNACKED_KEY = "unacked"  # kombu.transport.redis.Channel.unacked_key
MAX_QUEUED = 10_000  # queued runs looked at per pass (oldest first)


def reconcile_every() -> float:
    """Seconds between two passes of the web process: ``$RECONCILE_EVERY``, default 10."""
    raw = os.environ.get(RECONCILE_EVERY_ENV, "").strip()
    try:
        value = float(raw) if raw else 10.0
    except ValueError:
        raise ValueError(f"{RECONCILE_EVERY_ENV}={raw!r} is not a number of seconds (e.g. 10)") from None
    if value <= 0:
        raise ValueError(f"{RECONCILE_EVERY_ENV}={raw!r} must be > 0 seconds")
    return value


# --------------------------------------------------------------------------- the broker's view


@dataclass
class BrokerView:
    """Which runs have a message in the broker, as seen at one moment."""

    waiting: set[int] = field(default_factory=set)  # a message waits in its queue
    held: set[int] = field(default_factory=set)  # a worker received it and has not acknowledged it
    incarnation: str = ""  # the broker server's identity (Redis run_id): it changes on a restart

    def has_message(self, run_id: int) -> bool:
        return run_id in self.waiting or run_id in self.held


class Broker(Protocol):
    exact: bool  # whether a view shows every message (a held one included), so orphans are known

    def view(self, queues: set[str]) -> BrokerView: ...


def run_of_message(raw: bytes | str) -> int | None:
    """The run id a kombu message of ``jobs.supervise_run`` is for (None for any other message)."""
    try:
        message = json.loads(raw)
        if (message.get("headers") or {}).get("task") != SUPERVISE_TASK:
            return None
        body: Any = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _args, kwargs, *_ = json.loads(body)
        return int(kwargs["run_id"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class RedisBroker:
    exact = True

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)

    def view(self, queues: set[str]) -> BrokerView:
        keys = [
            q if pri == 0 else f"{q}{REDIS_PRIORITY_SEP}{pri}"
            for q in sorted(queues)
            for pri in REDIS_PRIORITY_STEPS
        ]
        with self.client.pipeline(transaction=True) as pipe:  # one snapshot (MULTI/EXEC)
            for key in keys:
                pipe.lrange(key, 0, -1)
            pipe.hvals(REDIS_UNACKED_KEY)
            replies = pipe.execute()
        view = BrokerView(incarnation=str(self.client.info("server").get("run_id", "")))
        for messages in replies[:-1]:
            view.waiting.update(r for r in map(run_of_message, messages) if r is not None)
        for raw in replies[-1]:
            with contextlib.suppress(ValueError, TypeError, IndexError):
                run = run_of_message(json.dumps(json.loads(raw)[0]))
                if run is not None:
                    view.held.add(run)
        return view


class FileBroker:
    exact = False

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def view(self, queues: set[str]) -> BrokerView:
        view = BrokerView()
        wanted = {f"{q}.msg" for q in queues}
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(self.folder)):
                if name.partition(".")[2] not in wanted:
                    continue
                with contextlib.suppress(OSError):  # taken by a worker meanwhile
                    run = run_of_message((self.folder / name).read_bytes())
                    if run is not None:
                        view.waiting.add(run)
        return view


_brokers: dict[str, Broker] = {}


def broker_from_env() -> Broker:
    """The broker the web app sends runs to (``jobs.app.broker_settings``); one client per
    process and broker (a Redis client keeps a pool of connections and is thread-safe)."""
    url = str(broker_settings().get("broker_url", ""))
    key = url if url.startswith(("redis://", "rediss://", "unix://")) else str(broker_folder() / "queue")
    if key not in _brokers:
        _brokers[key] = RedisBroker(url) if key == url else FileBroker(Path(key))
    return _brokers[key]


# --------------------------------------------------------------------------- the passes

_process_lock = threading.Lock()
_last_incarnation: dict[str, str] = {}


@contextlib.contextmanager
def _exclusive(wait: bool) -> Iterator[bool]:
    """One reconciler at a time: this process's lock, then (PostgreSQL) an advisory lock held
    until the transaction ends. Yields False when ``wait`` is False and another holds it."""
    if not _process_lock.acquire(blocking=wait):
        yield False
        return
    try:
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    if wait:
                        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_LOCK_KEY])
                    else:
                        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [ADVISORY_LOCK_KEY])
                        if not cursor.fetchone()[0]:
                            yield False
                            return
            yield True
    finally:
        _process_lock.release()


def _queued(queue: str | None = None) -> list[Run]:
    runs = Run.objects.filter(
        status=RunStatus.QUEUED, cancel_requested_at__isnull=True, origin=RunOrigin.ENGINE
    )
    if queue is not None:
        runs = runs.filter(queue=queue)
    return list(runs.select_related("resume_from").order_by("queued_at", "id")[:MAX_QUEUED])


def _note_incarnation(view: BrokerView) -> None:
    if not view.incarnation:
        return
    before = _last_incarnation.get("broker")
    _last_incarnation["broker"] = view.incarnation
    if before and before != view.incarnation:
        log.warning(
            "the broker restarted (its run_id changed): checking that every queued run has its message"
        )


def _orphans(
    runs: list[Run],
    broker: Broker,
    now: datetime,
    view: BrokerView | None = None,
    grace: float = SEND_GRACE_S,
) -> list[Run]:
    """The runs older than ``grace`` seconds with no message in two views ``CONFIRM_PAUSE_S``
    apart (the second closes the instant a worker holds a message it took and has not recorded
    yet)."""
    if not broker.exact:
        return []
    queues = {r.queue for r in runs}
    if view is None:
        view = broker.view(queues)
        _note_incarnation(view)
    recent = now - timedelta(seconds=grace)
    candidates = [r for r in runs if not view.has_message(r.pk) and r.queued_at <= recent]
    if not candidates:
        return []
    time.sleep(CONFIRM_PAUSE_S)
    again = broker.view(queues)
    still = set(
        Run.objects.filter(pk__in=[r.pk for r in candidates], status=RunStatus.QUEUED).values_list(
            "pk", flat=True
        )
    )
    return [r for r in candidates if r.pk in still and not again.has_message(r.pk)]


def _resend(runs: list[Run], why: str) -> list[int]:
    sent = []
    for run in runs:  # oldest first: each goes to the back of its queue, so they keep their order
        queue_run(run)
        log.warning("run %s (queue %s): %s; sent again", run.pk, run.queue, why)
        sent.append(run.pk)
    return sent


def reconcile_queued_runs(
    *, broker: Broker | None = None, now: datetime | None = None, wait: bool = False
) -> list[int]:
    """Send every orphaned queued run again, oldest first; returns their ids.

    Skips the pass (returns ``[]``) when another process is reconciling and ``wait`` is False."""
    with _exclusive(wait) as mine:
        if not mine:
            return []
        broker = broker or broker_from_env()
        runs = _queued() if broker.exact else []
        if not runs:
            return []
        orphans = _orphans(runs, broker, now or timezone.now())
        return _resend(orphans, "its queue message is gone (the broker lost it)")


def claim_order(run: Run, *, broker: Broker | None = None, now: datetime | None = None) -> str:
    """Whether the queued ``run`` may start now, by queue order: ``""`` if so, else why not.

    Asked when a supervisor attaches to it. Older queued runs of its queue go first when they are
    orphaned (they are re-sent now) or when their message waits in the queue (it was sent after
    this run's: a re-send). Then ``run`` itself is sent again, behind them, and the reason is
    returned: the supervisor that asked ends without starting it. An unreachable broker never
    holds a run back (its worker just got the message from it)."""
    older = [r for r in _queued(run.queue) if (r.queued_at, r.pk) < (run.queued_at, run.pk)]
    if not older:
        return ""
    try:
        with _exclusive(wait=True):
            broker = broker or broker_from_env()
            view = broker.view({run.queue})
            _note_incarnation(view)
            waiting = [r for r in older if r.pk in view.waiting]
            # No grace here: an older run about to be published is sent once more rather than
            # let a newer one overtake it (the claim makes the spare copy harmless).
            orphans = _orphans(older, broker, now or timezone.now(), view, grace=0)
            if not waiting and not orphans:
                return ""
            ahead = sorted({r.pk for r in waiting} | {r.pk for r in orphans})
            _resend(
                orphans,
                f"its queue message is gone (noticed as run {run.pk} of the same queue tried to start)",
            )
            if not Run.objects.filter(pk=run.pk, status=RunStatus.QUEUED).exists():
                return ""  # claimed or cancelled meanwhile: the claim itself decides
            reason = (
                f"run(s) {', '.join(map(str, ahead))} were queued on '{run.queue}' before it and have not started: "
                "it was sent again, behind them"
            )
            _resend([run], f"queued behind older run(s) {', '.join(map(str, ahead))}")
            return reason
    except Exception as exc:  # the broker is down: let the run start rather than stall it
        log.warning("run %s: queue order not checked (broker unreachable: %s)", run.pk, exc)
        return ""
