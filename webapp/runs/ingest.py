"""Storing the engine's events: validation, storable text, quarantine (``store_events``).

Shipping is at-least-once (ARCHITECTURE.md), so storing is idempotent: events at or below the run's
cursor (``Run.last_seq``) are skipped, the rest are stored in one transaction and the cursor
moves to the highest stored seq, which is what the ingest socket acknowledges.

One bad event must not stall a run (issue 13): the cursor can only move forward in order, so
an event that cannot be stored would otherwise block every later one, and the worker would
resend it forever. Hence three layers, each keeping the seq chain whole:

1. Text the database cannot hold (NUL, lone surrogates) is replaced by U+FFFD everywhere
   (text fields, metric names, JSON keys and values at any depth; ``tributary.events.clean``,
   the same function the engine's ``EventSink`` writes through), and JSON nested deeper than
   ``tributary.events.MAX_DEPTH`` is cut with a visible mark.
2. An event with a usable ``seq`` that breaks the protocol (a missing field, a negative step)
   is *quarantined*: a ``LogLine`` at level error takes its seq and says what was wrong, on the
   run's Logs tab; the batch goes on.
3. A batch the database refuses for its data (class 22/23/54 errors: a value out of range, a
   constraint) is retried event by event, each in a savepoint; the events that still fail
   are quarantined with the database's error. A database that is *down* (connection errors,
   timeouts, anything else) raises ``DatabaseError`` unchanged, so the socket closes with 1011
   and the worker resends later: nothing is quarantined because the database was unreachable.

Only an event without a usable seq (not an object, no integer ``seq``) refuses the whole batch
(``InvalidEvent``): the cursor cannot move past an event it cannot place.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, connection, transaction
from django.db.models import OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from engine.contracts import CLOSE_BAD_TOKEN, CLOSE_RUN_OVER, ENGINE_FINAL_STATES, ENGINE_STATES, EVENT_TYPES
from tributary.events import clean, clean_text
from webapp.alerts import monitor
from webapp.analysis import rollups, summaries
from webapp.live import announce
from webapp.runs.bulk import PointGroup, copy_points, insert_data, insert_point_groups
from webapp.runs.choices import LogLevel, RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, RunAttempt, Sample
from webapp.runs.tokens import TokenRejected, check_holder
from webapp.runs.wording import status_words

log = logging.getLogger(__name__)

MAX_NAME = 200
STEP_EVENTS = ("metrics", "samples", "checkpoint")
MAX_INT = 2**31 - 1  # integer columns (step, length)
MAX_BIGINT = 2**63 - 1  # bigint columns (seq, bytes)
MAX_TEXT = 1_000_000  # characters of one text field; a message is at most 4 MiB anyway
# SQLSTATE classes that mean "this data cannot be stored", not "the database is unavailable":
# 22 data exception, 23 integrity constraint violation, 54 program limit exceeded.
POISON_SQLSTATE_CLASSES = ("22", "23", "54")


class InvalidEvent(ValueError):
    """An event that does not follow the protocol (``seq`` and ``field`` say where)."""

    def __init__(self, seq: object, field: str, problem: str) -> None:
        self.seq, self.field = seq, field
        super().__init__(f"event seq {seq}: field {field!r} {problem}")


class SeqGap(InvalidEvent):
    """The batch does not continue the stored events; resend from ``expected``."""

    def __init__(self, seq: int, expected: int) -> None:
        self.expected = expected
        super().__init__(
            seq,
            "seq",
            f"leaves a gap: the run has every event up to {expected - 1}, so the next one must be "
            f"{expected}; resend from seq {expected}",
        )


class IngestClosed(TokenRejected):
    """The run's engine reported its final status at ``final_seq``: nothing after it is taken."""

    def __init__(self, run_id: int, final_seq: int, status: str) -> None:
        self.final_seq = final_seq
        super().__init__(
            CLOSE_RUN_OVER,
            f"run {run_id} is {status}: its engine's final status was event {final_seq}, and no "
            f"event after it is accepted; launch or resume a run to record more",
        )


@dataclass(frozen=True)
class Stored:
    """What one ingest call stored: the cursor before and after, and the new events (as
    validated, JSON-ready: what the live fan-out sent); ``quarantined`` lists the seqs replaced
    by an error log line."""

    previous_seq: int
    last_seq: int
    events: list[dict[str, Any]]
    quarantined: tuple[int, ...] = ()
    final: bool = False  # the run is in a final state after this batch: its token is not renewed
    run_id: int = 0
    project_id: int = 0
    step: int | None = None  # the run's last step, when this batch moved it


def store_events(
    run_id: int,
    events: Iterable[Mapping[str, Any]],
    *,
    attempt: int | None = None,
    claim: str = "",
    announce_events: bool = True,
) -> Stored:
    """Store a batch of engine events for run ``run_id`` idempotently.

    The batch may arrive out of order, repeat events already stored, or overlap an earlier
    batch. An event without a usable seq raises ``InvalidEvent`` and nothing is written; any
    other bad event is quarantined (see the module docstring). The new events must continue
    the stored ones without a gap (``last_seq + 1, + 2, ...``), else ``SeqGap`` says from which
    seq to resend, so a missing event can never be skipped past. A status event moves the run
    through its state machine; one the machine refuses (``running`` for a run already
    cancelled) is kept as a warning log line. The engine's final status closes the attempt:
    later events raise ``IngestClosed``. The run's watchers hear of the stored events and
    status changes once the batch commits (``webapp.live.announce``).

    ``announce_events=False``: the batch's events and its step are not announced from here; the
    caller sends them with ``announce.batch_stored`` once this returned (the batch is committed
    then). The ingest socket does, from its event loop, after its ack: each ``on_commit`` send
    from this thread is a hop to the loop and back that the worker's ack waited for (issue 19).
    Status changes and alerts are still announced at the commit, so before the events.

    ``attempt`` (from the ingest token) must be the run's current attempt, else
    ``TokenRejected``: a worker of an attempt the run has moved past writes nothing. ``claim``
    (an external run's socket: what its script attached with) must still hold the run
    (``tokens.check_holder``): a script whose run a copy of it took over writes nothing.
    """
    return store_validated(
        run_id, validated(events), attempt=attempt, claim=claim, announce_events=announce_events
    )


@dataclass(frozen=True)
class Prepared:
    """What storing a batch's metric points takes that no row of the database decides, built
    before the run's row is locked (``prepare``): the points grouped (``bulk.PointGroup``), the
    insert's data, the rollups' upsert and the summaries' fold.

    The ingest socket builds it in a thread of its own while the batch before is in the database
    (``IngestConsumer.receive``): built in the storing thread, this Python held the database idle
    for a seventh of the batch's time (issue 19: 0.17 s of 1.18 s for 100,000 points). It assumes
    what ingest all but always finds: every metrics event of the batch is new and the current
    attempt's; ``_store`` takes it only when its groups are the ones it builds, and
    the fold only when no stored summary is past the batch (``summaries.record``)."""

    groups: list[PointGroup]
    points: Any  # bulk.insert_data
    rollups: Any  # rollups.upsert_data
    summaries: dict[str, list[Any]]  # summaries.fold_new


def prepare(run_id: int, attempt_number: int, batch: list[dict[str, Any]]) -> Prepared:
    """``Prepared`` for ``batch`` (``validated``), stored under run ``run_id``'s ``RunAttempt``
    ``attempt_number``."""
    groups = _point_groups(run_id, attempt_number, batch)
    return Prepared(groups, insert_data(groups), rollups.upsert_data(groups), summaries.fold_new(groups))


def _point_groups(run_id: int, attempt: int, events: list[dict[str, Any]]) -> list[PointGroup]:
    """The metrics events' points, one group an event, each under the attempt whose engine wrote
    it (``TAIL``, else ``attempt``)."""
    return [
        PointGroup(run_id, e["step"], e["time"], e["seq"], e.get(TAIL, attempt), e["values"])
        for e in events
        if e["type"] == "metrics"
    ]


class Turn:
    """Where a batch of an ingest socket stands against the batch before it, when the socket
    stores the two at once (``IngestConsumer``, on PostgreSQL).

    Storing a batch is one transaction: its points' COPY, then the run's row lock, the cursor,
    the rollups and summaries, and the commit, whose deferred foreign-key checks cost PostgreSQL
    as much again as the COPY (issue 19). One batch at a time, a backend does all of it while
    the other core has little to do. Two at a time, the second copies its points while the first
    holds the row and commits, and the row lock keeps the order of their cursors: the second
    reads the first's cursor once that commits (``SELECT ... FOR UPDATE`` waits, then reads the
    committed row), so no gap and no duplicate, as one at a time.

    What it must not do is ask for the row *before* the first: it would find the cursor short of
    its first seq and answer with a gap. ``after`` (the batch before's ``held``) is set once that
    batch holds the row for good, or has ended; ``held`` is this batch's. For good: after the check
    of its copy (``_copied_all``), since a batch that lets go of the row to be stored again
    (``_Redo``) would find the next one in its place. (One the database refuses part of still
    does: the next is then answered with a gap and sent again, which is rare and costs no data.)
    Set any later, at the commit, the next batch's request for the row no longer waits in
    PostgreSQL's queue but starts after the commit is back here: ~3% of ``bench/ingest.py``."""

    def __init__(self, before: Turn | None = None) -> None:
        self.after = before.held if before is not None else None
        self.held = threading.Event()


class _Redo(Exception):
    """Store the batch again without copying its points before the row lock (``store_validated``):
    they are not what it stores, or it waited too long holding them (``TURN_WAIT_S``)."""


def store_validated(
    run_id: int,
    batch: list[dict[str, Any]],
    *,
    attempt: int | None = None,
    claim: str = "",
    announce_events: bool = True,
    prepared: Prepared | None = None,
    turn: Turn | None = None,
) -> Stored:
    """``store_events`` of a batch ``validated`` already: the ingest socket validates a batch (and
    builds its ``Prepared``) while the batch before it is in the database (``IngestConsumer.receive``).

    On PostgreSQL the prepared points are copied before the run's row is locked, so that a socket
    storing two batches at once (``Turn``) has the second's COPY run beside the first's locked
    part and commit.
    They are what the batch stores all but always (every metrics event new and the current
    attempt's); when they are not, when the batch meets data the database refuses, or when its
    turn is long in coming (``TURN_WAIT_S``), the transaction is rolled back and the batch stored
    again without them (``_Redo``)."""
    try:
        early = prepared is not None and connection.vendor == "postgresql"
        try:
            return _store_batch(run_id, batch, attempt, claim, announce_events, prepared, turn, early)
        except _Redo:
            return _store_batch(run_id, batch, attempt, claim, announce_events, prepared, turn, False)
    finally:
        if turn is not None:  # the batch after may ask for the row now (if it could not already)
            turn.held.set()


def _store_batch(
    run_id: int,
    batch: list[dict[str, Any]],
    attempt: int | None,
    claim: str,
    announce_events: bool,
    prepared: Prepared | None,
    turn: Turn | None,
    early: bool,
) -> Stored:
    if not early:  # nothing to do before the lock: wait outside the transaction (SQLite's is its lock)
        if turn is not None and turn.after is not None and not turn.after.is_set() and not connection.in_atomic_block:
            connection.close()  # nor hold a connection of the pool the batch before may need
        _wait_for_turn(turn)
    with transaction.atomic():
        # Before the row lock: beside the commit of the batch before (Turn). The savepoint of
        # copy_points undoes a COPY the database refused (a point stored already), and the batch
        # is then stored as if nothing was copied.
        copied = early and prepared is not None and _copy_early(prepared)
        if early and not _wait_for_turn(turn, TURN_WAIT_S):
            raise _Redo  # let go of what the copy holds, and wait without it
        # The row lock serialises two connections ingesting the same run (no-op on SQLite,
        # where IMMEDIATE transactions already serialise writers).
        locked = _runs_to_lock().get(pk=run_id)
        if attempt is not None and attempt != locked.attempt:
            raise TokenRejected(CLOSE_BAD_TOKEN, stale_attempt_reason(run_id, attempt, locked.attempt))
        check_holder(locked, claim)
        previous = locked.last_seq
        fresh = [e for e in batch if e["seq"] > previous]
        if fresh and locked.final_seq is not None and fresh[0]["seq"] > locked.final_seq:
            raise IngestClosed(run_id, locked.final_seq, str(locked.status))
        fresh = _through_final_status(_mark_tail(locked, fresh))
        public: list[dict[str, Any]] = []
        step: int | None = None
        if copied and not _copied_all(locked, fresh, prepared):
            raise _Redo  # the copied points are rolled back with everything else
        if turn is not None:  # the row is this batch's until it commits (Turn)
            turn.held.set()
        if fresh:
            _check_contiguous(previous, fresh)
            step_before = locked.last_step
            fresh = _store_or_quarantine(locked, fresh, prepared, copied)
            if locked.last_step != step_before:  # the lists of runs follow the step (throttled)
                step = locked.last_step
            public = [_public(e, locked.attempt_number) for e in fresh]
    quarantined = tuple(e["seq"] for e in fresh if e.get("quarantined"))
    stored = Stored(
        previous,
        fresh[-1]["seq"] if fresh else previous,
        public,
        quarantined,
        RunStatus(locked.status).is_final,
        run_id,
        locked.project_id,
        step,
    )
    if announce_events:  # now (committed), or when a transaction of the caller commits
        announce.batch_stored_sync(stored)
    return stored


TURN_WAIT_S = 5.0
"""How long a batch waits for its turn (``Turn``) inside its transaction, holding the points it
copied. PostgreSQL cannot see that wait: should the batch before wait in the database for
something that waits for this batch's locks, neither would ever move. Another socket of the run
copying the same points can make that happen, and so can the batch before's own COPY when an
engine logged one metric twice at a step, once in each batch. Past this the batch rolls back, so
letting go of its locks, waits outside any transaction, and is stored the usual way. The batch
before normally holds the row within ~0.15 s (``bench/ingest.py``: a 500-event batch's COPY, and
the locked part and commit of the batch before it)."""


def _wait_for_turn(turn: Turn | None, timeout: float | None = None) -> bool:
    """Until the batch before holds the row for good (or has ended); False when ``timeout``
    seconds passed first."""
    return turn is None or turn.after is None or turn.after.wait(timeout)


def _copy_early(prepared: Prepared) -> bool:
    """Copy the prepared points before the row lock; whether they are in the table now. Not when
    there are none, nor when the database refuses them for their data: a point stored already
    (a batch the run has, sent again), a value or a name it cannot hold; the batch is then
    stored the usual way, which keeps the stored points and quarantines what cannot be stored."""
    if not any(group.values for group in prepared.groups):
        return False
    try:
        copy_points(prepared.points)
    except DatabaseError as exc:
        if not is_poison(exc):
            raise
        return False
    return True


def _copied_all(run: Run, fresh: list[dict[str, Any]], prepared: Prepared | None) -> bool:
    """Whether the points copied before the row lock (``prepared``'s) are exactly the metrics
    points ``fresh`` stores, and nothing reads them back before they are counted: the first
    metrics of a resumed attempt rewind the run (``_supersede``), whose rebuilt summaries and
    rollups would count them twice."""
    if prepared is None or prepared.groups != _point_groups(run.pk, run.attempt_number, fresh):
        return False
    return run.attempt_number == 1 or getattr(run, "attempt_first_step", None) is not None


def stale_attempt_reason(run_id: int, attempt: int, current: int) -> str:
    return (
        f"the token is for attempt {attempt} of run {run_id}, but the run was queued again "
        f"(attempt {current}): only the worker of the current attempt may ship its events"
    )


def _through_final_status(fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events up to the engine's first final status: the engine writes nothing after it,
    so what follows is not the attempt's and is not stored (the next batch is refused)."""
    for i, event in enumerate(fresh):
        if event["type"] == "status" and event["state"] in ENGINE_FINAL_STATES and TAIL not in event:
            return fresh[: i + 1]
    return fresh


TAIL = "tail_of"
"""The key ``_mark_tail`` sets on an event an earlier attempt's engine wrote: that attempt's number."""


@functools.cache
def _runs_to_lock() -> QuerySet[Run]:
    """The query a batch locks its run's row with, the project's alert settings and the current
    attempt's fields read with it; built once a process and cloned by each ``get`` (never
    evaluated itself, so threads may share it). Building it, its four subqueries resolved, cost
    a batch more than running it: 8 ms of a one-event batch's ~18 ms on a slow machine, 4 ms
    built once and without the subqueries' ORDER BY (issue 19's live path)."""
    return _with_engine_from(monitor.with_project_settings(Run.objects.select_for_update(of=("self",)).order_by()))


def _with_engine_from(runs: QuerySet[Run]) -> QuerySet[Run]:
    """``runs`` with their current attempt's ``engine_from_seq`` (as ``engine_from``) and
    ``first_step`` (as ``attempt_first_step``: ``_supersede`` claims it only while unset), read
    with the row. (One attempt matches: no ORDER BY, which the model's default would add.)"""
    current = RunAttempt.objects.filter(run_id=OuterRef("pk"), number=OuterRef("attempt_number")).order_by()
    return runs.annotate(
        engine_from=Subquery(current.values("engine_from_seq")[:1]),
        attempt_first_step=Subquery(current.values("first_step")[:1]),
    )


def _mark_tail(run: Run, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark the events an earlier attempt's engine wrote and nobody shipped (``TAIL``).

    A resumed attempt runs in the directory of the one before; when that one's worker died, its
    engine went on to checkpoint and write its final status, and none of it reached the web app
    (a directory the web app can read is stored at the resume: ``services.store_dead_tail``). The
    new supervisor's shipper sends those seqs first: they are the earlier attempt's, and the
    supervisor said where they end (``engine_from`` in ``attach``, ``client/tributary/protocol.py``). They are
    stored under that attempt's number, and their statuses, final included, as words only: a dead
    engine's "cancelled" must not end the attempt that resumed it."""
    until = getattr(run, "engine_from", None)
    if not fresh or until is None or run.attempt_number <= 1 or fresh[0]["seq"] > until:
        return fresh
    owner = (
        RunAttempt.objects.filter(run_id=run.pk, number__lt=run.attempt_number, started_at__isnull=False)
        .order_by("-number")
        .values_list("number", flat=True)
        .first()
    ) or run.attempt_number - 1
    for event in fresh:
        if event["seq"] <= until:
            event[TAIL] = owner
    return fresh


def _public(event: dict[str, Any], attempt: int) -> dict[str, Any]:
    """A validated event as JSON for browsers (times as Unix seconds; a status event's message in
    the words the run's status message shows, ``webapp.runs.wording``). An event with a step
    says which attempt logged it, so a page applies a rewind as the database did (``_supersede``)."""
    out = {k: v for k, v in event.items() if k not in ("quarantined", "non_finite", TAIL, "deleted")}
    if out.get("type") in STEP_EVENTS:
        out["attempt"] = event.get(TAIL, attempt)
    if out.get("type") == "checkpoint":  # the stored checkpoints its save deleted, by seq (``_mark_deleted``)
        out["deleted_seqs"] = event.get("deleted_seqs", [])
    if out.get("type") == "status" and isinstance(out.get("message"), str):
        out["message"] = status_words(out["message"])
    if isinstance(out.get("time"), datetime):
        out["time"] = out["time"].timestamp()
    return out


# --- validation ------------------------------------------------------------------------


def validated(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The batch checked, in seq order, one event a seq: an event without a usable seq raises
    ``InvalidEvent`` (nothing of the batch is stored), any other bad event is replaced by its
    quarantine. Reads no database, so it may run before the run's row is locked."""
    by_seq: dict[int, dict[str, Any]] = {}
    for position, event in enumerate(events):
        if not isinstance(event, Mapping):
            raise InvalidEvent(
                f"? (item {position})", "event", f"must be a JSON object, got {type(event).__name__}"
            )
        seq = event.get("seq")
        if not _is_int(seq) or not 1 <= seq <= MAX_BIGINT:
            raise InvalidEvent(f"? (item {position})", "seq", f"must be an integer in [1, 2^63), got {seq!r}")
        try:
            checked = _check_event(seq, event)
        except InvalidEvent as exc:
            checked = quarantine(seq, event.get("type"), f"it breaks the event protocol: {exc}")
        # A repeated seq inside one batch is the same event sent twice: keep one.
        by_seq.setdefault(seq, checked)
    return [by_seq[s] for s in sorted(by_seq)]


def quarantine(seq: int, kind: object, why: str) -> dict[str, Any]:
    """The ``log`` event (level error) that takes the place of event ``seq`` which cannot be
    stored: the cursor moves past it, and the run's Logs tab says what was lost and why."""
    kind_text = clean_text(kind)[:40] if isinstance(kind, str) else "?"
    message = (
        f"event {seq} ({kind_text}) was quarantined, not stored: {clean_text(why)[:2000]}. "
        f"The worker's event log (events.jsonl in the run's directory) still holds it."
    )
    log.warning("event %s (%s) quarantined: %s", seq, kind_text, why)
    return {
        "seq": seq,
        "type": "log",
        "level": LogLevel.ERROR.value,
        "message": message,
        "quarantined": True,
    }


_NAMES: dict[str, str] = {}
"""Metric names as received -> as stored (``clean_text``), for names already found valid: validating
a batch of 500 events of 50 metrics checks 50 names, not 25,000. Shared by the web process's
threads (a dict's get and set are atomic); cleared when it holds ``MAX_NAMES_KEPT``."""
MAX_NAMES_KEPT = 10_000
_CLEAN_NAMES: set[str] = set()
"""The names of ``_NAMES`` stored as received (already clean, the usual case): a metrics event whose
names are all here and whose values are all finite floats is taken as a whole (``_plain_values``)."""
_isfinite = math.isfinite
_FLOAT_ONLY = {float}


def _check_event(seq: int, event: Mapping[str, Any]) -> dict[str, Any]:
    kind = event.get("type")
    if kind not in EVENT_TYPES:
        shown = clean(kind) if isinstance(kind, str) else kind
        raise InvalidEvent(seq, "type", f"is {shown!r}; known types: {', '.join(EVENT_TYPES)}")
    out: dict[str, Any] = {"seq": seq, "type": kind}
    if kind == "status":
        state = _require(seq, event, "state")
        if state not in ENGINE_STATES:
            raise InvalidEvent(seq, "state", f"is {_shown(state)}; known states: {', '.join(ENGINE_STATES)}")
        out.update(state=state, message=_text(seq, event, "message", required=False))
    elif kind == "metrics":
        out.update(step=_step(seq, event), time=_time(seq, event))
        values = _require(seq, event, "values")
        if not isinstance(values, Mapping):
            raise InvalidEvent(seq, "values", "must be an object {name: number}")
        if _plain_values(values):
            out["values"] = dict(values)
            return out
        clean_values: dict[str, float] = {}
        non_finite: list[str] = []
        for raw_name, value in values.items():
            # A run logs the same tens of names at every step: each is checked once (_NAMES).
            name = _NAMES.get(raw_name) if isinstance(raw_name, str) else None
            if name is None:
                name = clean_text(raw_name) if isinstance(raw_name, str) else raw_name
                if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                    raise InvalidEvent(
                        seq, "values", f"has a bad metric name {_shown(name)} (1-{MAX_NAME} characters)"
                    )
                if len(_NAMES) >= MAX_NAMES_KEPT:
                    _NAMES.clear()
                    _CLEAN_NAMES.clear()
                _NAMES[raw_name] = name
                if name == raw_name:
                    _CLEAN_NAMES.add(name)
            # The common case first: a finite float, as JSON decodes a number with a point.
            if type(value) is float and _isfinite(value):
                clean_values[name] = value
            # The engine sends a non-finite metric as null (JSON has no NaN): nothing to plot,
            # but the health rules hear of it (a NaN loss, ``webapp.alerts.rules.NonFinite``).
            elif value is None:
                non_finite.append(name)
            else:
                clean_values[name] = _finite(seq, f"values.{name}", value)
        out["values"] = clean_values
        if non_finite:
            out["non_finite"] = non_finite
    elif kind == "samples":
        out["step"] = _step(seq, event)
        items = _require(seq, event, "items")
        if not isinstance(items, list):
            raise InvalidEvent(seq, "items", "must be a list of samples")
        out["items"] = [_sample(seq, f"items[{i}]", item) for i, item in enumerate(items)]
    elif kind == "checkpoint":
        out.update(step=_step(seq, event), path=_text(seq, event, "path"))
        size = _require(seq, event, "bytes")
        if not _is_int(size) or not 0 <= size <= MAX_BIGINT:
            raise InvalidEvent(seq, "bytes", f"must be an integer in [0, 2^63), got {_shown(size)}")
        out["bytes"] = size
        deleted = event.get("deleted", [])  # optional: an older engine or a client may leave it out
        if not isinstance(deleted, list):
            raise InvalidEvent(seq, "deleted", f"must be a list of checkpoint paths, got {_shown(deleted)}")
        for i, path in enumerate(deleted):
            if not isinstance(path, str) or len(path) > MAX_TEXT:
                raise InvalidEvent(seq, f"deleted[{i}]", f"must be a path of at most {MAX_TEXT} characters, got {_shown(path)}")
        out["deleted"] = [clean_text(path) for path in deleted]
    elif kind == "log":
        level = _text(seq, event, "level").lower()
        if level not in LogLevel.values:
            raise InvalidEvent(seq, "level", f"is {level!r}; known levels: {', '.join(LogLevel.values)}")
        out.update(level=level, message=_text(seq, event, "message", required=False))
    else:  # heartbeat
        out["time"] = _time(seq, event)
    return out


def _plain_values(values: Mapping[str, Any]) -> bool:
    """Whether a metrics event's values are what the loop of ``_check_event`` would keep as they
    are: every name one it found clean before (``_CLEAN_NAMES``), every value a float, and their
    sum finite (so none is NaN or infinite; a sum that overflows only sends the event through
    the loop). Checked by whole-dict operations, ~5 µs for 50 values instead of ~15 µs (issue 19)."""
    if type(values) is not dict or not values or not values.keys() <= _CLEAN_NAMES:
        return False
    numbers = values.values()
    return set(map(type, numbers)) == _FLOAT_ONLY and _isfinite(sum(numbers))


def _sample(seq: int, where: str, item: object) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise InvalidEvent(seq, where, "must be an object")
    extra = item.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise InvalidEvent(seq, f"{where}.extra", "must be an object")
    length = item.get("length", 0)
    if not _is_int(length) or not 0 <= length <= MAX_INT:
        raise InvalidEvent(seq, f"{where}.length", f"must be an integer in [0, 2^31), got {_shown(length)}")
    return {
        "prompt": _text(seq, item, "prompt", where=where),
        "completion": _text(seq, item, "completion", where=where),
        "reward": _optional_finite(seq, f"{where}.reward", item.get("reward")),
        "advantage": _optional_finite(seq, f"{where}.advantage", item.get("advantage")),
        "length": length,
        "finish_reason": _text(seq, item, "finish_reason", required=False, where=where)[:32],
        # Depth as in the whole event (tributary.events.clean): the event 1, items 2, an item 3,
        # extra 4, so the engine's cut and this one agree.
        "extra": clean(dict(extra), depth=4) if extra else {},
    }


def _shown(value: object) -> str:
    """``repr`` of a bad value for an error message: storable, and short."""
    text = clean_text(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(seq: int, event: Mapping[str, Any], field: str, where: str = "") -> Any:
    if field not in event:
        raise InvalidEvent(seq, f"{where}.{field}" if where else field, "is missing")
    return event[field]


def _text(seq: int, event: Mapping[str, Any], field: str, *, required: bool = True, where: str = "") -> str:
    name = f"{where}.{field}" if where else field
    value = _require(seq, event, field, where) if required else event.get(field, "")
    value = "" if value is None and not required else value
    if not isinstance(value, str):
        raise InvalidEvent(seq, name, f"must be a string, got {_shown(value)}")
    if len(value) > MAX_TEXT:
        raise InvalidEvent(seq, name, f"has {len(value)} characters; the limit is {MAX_TEXT}")
    return clean_text(value)


def _step(seq: int, event: Mapping[str, Any]) -> int:
    step = _require(seq, event, "step")
    if not _is_int(step) or not 0 <= step <= MAX_INT:
        raise InvalidEvent(seq, "step", f"must be an integer in [0, 2^31), got {_shown(step)}")
    return step


def _finite(seq: int, field: str, value: object) -> float:
    if _is_int(value) or isinstance(value, float):
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:  # an integer beyond any float
            number = math.inf
        if math.isfinite(number):
            return number
    raise InvalidEvent(seq, clean_text(field), f"must be a finite number, got {_shown(value)}")


def _optional_finite(seq: int, field: str, value: object) -> float | None:
    return None if value is None else _finite(seq, field, value)


def _time(seq: int, event: Mapping[str, Any]) -> datetime:
    stamp = _finite(seq, "time", _require(seq, event, "time"))
    try:
        return datetime.fromtimestamp(stamp, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise InvalidEvent(seq, "time", f"is not a Unix time in seconds: {stamp!r}") from None


def _check_contiguous(last_seq: int, fresh: list[dict[str, Any]]) -> None:
    expected = last_seq + 1
    for event in fresh:
        if event["seq"] != expected:
            raise SeqGap(event["seq"], expected)
        expected += 1


# --- storing ---------------------------------------------------------------------------


def is_poison(exc: BaseException) -> bool:
    """Whether a storing error is about the data (quarantine the event) rather than the
    database being unreachable or busy (close 1011 so the worker resends later).

    Judged by the SQLSTATE class the driver reports (PostgreSQL) or the exception class
    Django maps it to (SQLite has no SQLSTATE: its data errors are IntegrityError/DataError).
    Python-side errors while preparing rows (a value the driver cannot bind) are data too."""
    if not isinstance(exc, DatabaseError):
        return isinstance(exc, ValueError | TypeError | OverflowError | RecursionError)
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate[:2] in POISON_SQLSTATE_CLASSES
    return isinstance(exc, DataError | IntegrityError)


def _store_or_quarantine(
    run: Run, fresh: list[dict[str, Any]], prepared: Prepared | None = None, copied: bool = False
) -> list[dict[str, Any]]:
    """Store ``fresh`` in one savepoint; if the database refuses its data, store the events
    one by one, each in its own savepoint, and quarantine those it still refuses.

    ``copied``: the batch's points are in the table already (``store_validated``), outside the
    savepoint; a refused batch is then stored again without them (``_Redo``), so that a
    quarantined event leaves no point behind.

    Returns the events as stored (a quarantined one replaced by its error log event)."""
    try:
        with transaction.atomic():
            _store(run, fresh, prepared, copied)
        return fresh
    except Exception as exc:
        if not is_poison(exc) or (len(fresh) == 1 and fresh[0].get("quarantined")):
            raise
        if copied:
            raise _Redo from exc
        log.warning(
            "run %s: a batch of %d events was refused (%s); storing one by one", run.pk, len(fresh), exc
        )
    out: list[dict[str, Any]] = []
    for event in fresh:
        run.refresh_from_db()  # the failed savepoint rolled back what _store had set on it
        try:
            with transaction.atomic():
                _store(run, [event])
            out.append(event)
            continue
        except Exception as exc:
            if not is_poison(exc):
                raise
            stand_in = quarantine(event["seq"], event["type"], f"the database refused it: {exc}")
        run.refresh_from_db()
        with transaction.atomic():
            _store(run, [stand_in])
        out.append(stand_in)
    return out


def _mark_deleted(run_id: int, event: dict[str, Any]) -> None:
    """The checkpoints at ``event["deleted"]``'s paths that the run stored before it have had their
    files deleted by its save (``engine.checkpoint.save_checkpoint``): no longer offered. A later
    checkpoint written at one of these paths (a rewound branch saving the same step again) is not
    touched: only rows of earlier seqs. Their seqs go to the run's pages with the event in place of
    the paths (``deleted_seqs``: a page knows its rows by seq), as ``webapp.live.replay`` rebuilds it."""
    seq, paths, seqs = event["seq"], event["deleted"], []
    for start in range(0, len(paths), 500):  # within SQLite's bound on query parameters
        rows = Checkpoint.objects.filter(
            run_id=run_id, seq__lt=seq, path__in=paths[start : start + 500], deleted_at_seq__isnull=True
        )
        seqs += rows.values_list("seq", flat=True)
        rows.update(deleted_at_seq=seq)
    event["deleted_seqs"] = sorted(seqs)


def _store(run: Run, fresh: list[dict[str, Any]], prepared: Prepared | None = None, copied: bool = False) -> None:
    """Store ``fresh`` under the locked ``run``; ``copied``: its points are in the table already
    (``prepared``'s, which ``_copied_all`` found to be the batch's)."""
    now = timezone.now()
    attempt = run.attempt_number
    run_id = run.pk
    groups = _point_groups(run_id, attempt, fresh)  # the metrics events' points, one group an event
    samples: list[Sample] = []
    checkpoints: list[Checkpoint] = []
    deletions: list[dict[str, Any]] = []  # the checkpoint events whose saves deleted earlier ones
    logs: list[LogLine] = []
    summary = dict(run.summary)
    last_step = _supersede(run, fresh)
    steps_before = last_step
    final_seq = run.final_seq

    for event in fresh:
        seq, kind = event["seq"], event["type"]
        owner = event.get(TAIL, attempt)  # the attempt whose engine wrote it
        if kind == "metrics":
            summary.update(event["values"])
            last_step = max(last_step, event["step"])
        elif kind == "samples":
            samples.extend(
                Sample(run=run, step=event["step"], seq=seq, index=i, attempt=owner, **item)
                for i, item in enumerate(event["items"])
            )
        elif kind == "checkpoint":
            checkpoints.append(
                Checkpoint(
                    run=run,
                    seq=seq,
                    step=event["step"],
                    path=event["path"],
                    bytes=event["bytes"],
                    attempt=owner,
                )
            )
            if event.get("deleted"):
                deletions.append(event)
        elif kind == "log":
            logs.append(LogLine(run=run, seq=seq, level=event["level"], message=event["message"], time=now))
        elif kind == "status" and TAIL in event:
            said = f": {event['message']}" if event["message"] else ""
            words = (
                f"attempt {owner}'s engine reported {event['state']!r}{said} "
                f"(shipped after the resume; attempt {attempt} goes on)"
            )
            logs.append(LogLine(run=run, seq=seq, level=LogLevel.INFO, message=words, time=now))
        elif kind == "status":
            refused = _apply_status(run, event["state"], event["message"])
            if refused:
                logs.append(LogLine(run=run, seq=seq, level=LogLevel.WARNING, message=refused, time=now))
            if event["state"] in ENGINE_FINAL_STATES and final_seq is None:
                final_seq = seq

    # What was built before the row lock, if these are its groups (equal tuples: the same events'
    # steps, times, seqs and values, and every one this attempt's).
    ready = prepared if prepared is not None and (copied or prepared.groups == groups) else None
    # ignore_conflicts: a row already stored (the same event under an older cursor, or an
    # engine logging a metric twice in one step) keeps its first value.
    all_stored = copied or insert_point_groups(groups, data=ready.points if ready else None)
    # The runs table's last/min/max per metric (webapp.analysis); no stored summary is past the
    # run's last step before this batch, so a batch after it needs no read of theirs.
    summaries.record(groups, steps_to=steps_before, new=ready.summaries if ready else None)
    # The blocks long series are downsampled from (webapp.analysis): from the batch's points when
    # the database took them all, else from the rows it kept.
    rollups.record(run.pk, groups, all_stored=all_stored, data=ready.rollups if ready else None)
    alert_state = monitor.observe(run, fresh)
    Sample.objects.bulk_create(samples, batch_size=500, ignore_conflicts=True)
    Checkpoint.objects.bulk_create(checkpoints, ignore_conflicts=True)
    for event in deletions:  # after the batch's own: a save may delete one stored just before it
        _mark_deleted(run_id, event)
    LogLine.objects.bulk_create(logs, batch_size=1000, ignore_conflicts=True)
    # heartbeat_at is progress: an event of the engine was stored (sweeper.py).
    updates = {
        "last_seq": fresh[-1]["seq"],
        "last_step": last_step,
        "summary": summary,
        "heartbeat_at": now,
        "final_seq": final_seq,
        "alert_state": alert_state,  # the health rules' state, moved with the cursor
    }
    Run.objects.filter(pk=run.pk).update(**updates)
    for name, value in updates.items():
        setattr(run, name, value)
    # Each attempt's seqs: an earlier engine's tail extends that attempt's range, not this one's.
    by_attempt: dict[int, list[int]] = {}
    for event in fresh:
        by_attempt.setdefault(event.get(TAIL, attempt), []).append(event["seq"])
    for number, seqs in by_attempt.items():  # one UPDATE each: first_seq only while unset
        RunAttempt.objects.filter(run_id=run.pk, number=number).update(
            first_seq=Coalesce("first_seq", Value(seqs[0], output_field=_FIRST_SEQ)), last_seq=seqs[-1]
        )


_FIRST_SEQ = RunAttempt._meta.get_field("first_seq")


def _supersede(run: Run, fresh: list[dict[str, Any]]) -> int:
    """Apply a rewind: the run's last step once this batch's first step is known.

    The first metrics or samples event of an attempt at step ``s`` says where its engine took up
    the run; whatever earlier attempts recorded at ``s`` or later is off the run's history now
    (W&B's rewind): their points, samples and checkpoints are marked ``superseded`` (kept, each
    under its own seq, so the stored events still equal the engines' logs) and the run's last
    step falls back to ``s - 1`` before this batch counts. Done once per attempt
    (``RunAttempt.first_step``); a page applies the same rule to the events it holds
    (``static/tributary/series.js``)."""
    number = run.attempt_number
    first = next((e["step"] for e in fresh if e["type"] in ("metrics", "samples") and TAIL not in e), None)
    if first is None or getattr(run, "attempt_first_step", None) is not None:
        return run.last_step  # no step yet, or the attempt's first step is claimed already
    claimed = RunAttempt.objects.filter(run_id=run.pk, number=number, first_step__isnull=True).update(
        first_step=first
    )
    if not claimed or number == 1:
        return run.last_step
    older = {"run_id": run.pk, "attempt__lt": number, "superseded": False, "step__gte": first}
    hidden = MetricPoint.objects.filter(**older).update(superseded=True)
    Sample.objects.filter(**older).update(superseded=True)
    Checkpoint.objects.filter(**older).update(superseded=True)
    if hidden:
        summaries.rebuild(run.pk)  # a rewound history's min, max and last value
        rollups.rewind(run.pk, first)  # the blocks from the step it resumed at
        log.info("run %s: attempt %d resumed at step %d: %d points superseded", run.pk, number, first, hidden)
    return min(run.last_step, first - 1)


def _apply_status(run: Run, state: str, message: str) -> str:
    """Apply an engine status event; return why it was refused ("" when applied or repeated)."""
    target = RunStatus(state)
    if run.status == target:
        # The same state with news: a preparing run's phase ("loading the model", "building the
        # starter policy: 180/1500 steps", engine/phases.py) is its status line until the next.
        if message and message != run.status_message and not target.is_final:
            Run.objects.filter(pk=run.pk, status=target).update(status_message=message)
            run.status_message = message
            announce.status_changed(run.pk, queue_moved=False)
        return ""
    if not RunStatus(run.status).can_become(target):
        return f"status {state!r} from the engine not applied: the run is {run.status!r}" + (
            f" ({message})" if message else ""
        )
    # The row is locked by store_events, so this conditional update cannot lose a race.
    run.transition(target, message=message)
    announce.status_changed(run.pk)  # registered before the batch's events: watchers hear it first
    return ""
