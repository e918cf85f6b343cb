"""Run logic that spans models. Here: storing a batch of engine events (``store_events``).

Shipping is at-least-once (DESIGN.md), so storing is idempotent: events at or below the run's
cursor (``Run.last_seq``) are skipped, the rest are stored in one transaction and the cursor
moves to the highest stored seq, which is what the ingest socket acknowledges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from engine.events import EVENT_TYPES
from webapp.runs.bulk import PointRow, insert_metric_points
from webapp.runs.choices import LogLevel, RunStatus
from webapp.runs.models import Checkpoint, LogLine, Run, Sample

ENGINE_STATES = ("starting", "running", "succeeded", "failed", "cancelled")
MAX_NAME = 200


class InvalidEvent(ValueError):
    """An event that does not follow the protocol; the whole batch is refused."""

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


@dataclass(frozen=True)
class Stored:
    """What one ingest call stored: the cursor before and after, and the new events (as
    validated, JSON-ready) for the live fan-out."""

    previous_seq: int
    last_seq: int
    events: list[dict[str, Any]]


def store_events(run_id: int, events: Iterable[Mapping[str, Any]]) -> Stored:
    """Store a batch of engine events for run ``run_id`` idempotently.

    The batch may arrive out of order, repeat events already stored, or overlap an earlier
    batch. Every event is validated first: a bad one raises ``InvalidEvent`` (a ValueError
    naming the seq and field) and nothing is written. The new events must continue the
    stored ones without a gap (``last_seq + 1, + 2, ...``), else ``SeqGap`` says from which
    seq to resend, so a missing event can never be skipped past. A status event moves the
    run through its state machine; one the machine refuses (for example ``running`` for a
    run already cancelled) is kept as a warning log line instead of failing the batch, so
    the worker's resend cannot loop on it forever.
    """
    batch = _validated(events)
    with transaction.atomic():
        # The row lock serialises two connections ingesting the same run (no-op on SQLite,
        # where IMMEDIATE transactions already serialise writers).
        locked = Run.objects.select_for_update().get(pk=run_id)
        previous = locked.last_seq
        fresh = [e for e in batch if e["seq"] > previous]
        if fresh:
            _check_contiguous(previous, fresh)
            _store(locked, fresh)
    return Stored(previous, fresh[-1]["seq"] if fresh else previous, [_public(e) for e in fresh])


def _public(event: dict[str, Any]) -> dict[str, Any]:
    """A validated event as JSON for browsers (times as Unix seconds)."""
    out = dict(event)
    if isinstance(out.get("time"), datetime):
        out["time"] = out["time"].timestamp()
    return out


# --- validation ------------------------------------------------------------------------


def _validated(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    by_seq: dict[int, dict[str, Any]] = {}
    for position, event in enumerate(events):
        if not isinstance(event, Mapping):
            raise InvalidEvent(
                f"? (item {position})", "event", f"must be a JSON object, got {type(event).__name__}"
            )
        seq = event.get("seq")
        if not _is_int(seq) or seq < 1:
            raise InvalidEvent(f"? (item {position})", "seq", f"must be an integer >= 1, got {seq!r}")
        checked = _check_event(seq, event)
        # A repeated seq inside one batch is the same event sent twice: keep one.
        by_seq.setdefault(seq, checked)
    return [by_seq[s] for s in sorted(by_seq)]


def _check_event(seq: int, event: Mapping[str, Any]) -> dict[str, Any]:
    kind = event.get("type")
    if kind not in EVENT_TYPES:
        raise InvalidEvent(seq, "type", f"is {kind!r}; known types: {', '.join(EVENT_TYPES)}")
    out: dict[str, Any] = {"seq": seq, "type": kind}
    if kind == "status":
        state = _require(seq, event, "state")
        if state not in ENGINE_STATES:
            raise InvalidEvent(seq, "state", f"is {state!r}; known states: {', '.join(ENGINE_STATES)}")
        out.update(state=state, message=_text(seq, event, "message", required=False))
    elif kind == "metrics":
        out.update(step=_step(seq, event), time=_time(seq, event))
        values = _require(seq, event, "values")
        if not isinstance(values, Mapping):
            raise InvalidEvent(seq, "values", "must be an object {name: number}")
        clean: dict[str, float] = {}
        for name, value in values.items():
            if not isinstance(name, str) or not name or len(name) > MAX_NAME:
                raise InvalidEvent(seq, "values", f"has a bad metric name {name!r} (1-{MAX_NAME} characters)")
            # The engine sends a non-finite metric as null (JSON has no NaN): nothing to plot.
            if value is None:
                continue
            clean[name] = _finite(seq, f"values.{name}", value)
        out["values"] = clean
    elif kind == "samples":
        out["step"] = _step(seq, event)
        items = _require(seq, event, "items")
        if not isinstance(items, list):
            raise InvalidEvent(seq, "items", "must be a list of samples")
        out["items"] = [_sample(seq, f"items[{i}]", item) for i, item in enumerate(items)]
    elif kind == "checkpoint":
        out.update(step=_step(seq, event), path=_text(seq, event, "path"))
        size = _require(seq, event, "bytes")
        if not _is_int(size) or size < 0:
            raise InvalidEvent(seq, "bytes", f"must be an integer >= 0, got {size!r}")
        out["bytes"] = size
    elif kind == "log":
        level = _text(seq, event, "level").lower()
        if level not in LogLevel.values:
            raise InvalidEvent(seq, "level", f"is {level!r}; known levels: {', '.join(LogLevel.values)}")
        out.update(level=level, message=_text(seq, event, "message", required=False))
    else:  # heartbeat
        out["time"] = _time(seq, event)
    return out


def _sample(seq: int, where: str, item: object) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        raise InvalidEvent(seq, where, "must be an object")
    extra = item.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise InvalidEvent(seq, f"{where}.extra", "must be an object")
    length = item.get("length", 0)
    if not _is_int(length) or length < 0:
        raise InvalidEvent(seq, f"{where}.length", f"must be an integer >= 0, got {length!r}")
    return {
        "prompt": _text(seq, item, "prompt", where=where),
        "completion": _text(seq, item, "completion", where=where),
        "reward": _optional_finite(seq, f"{where}.reward", item.get("reward")),
        "advantage": _optional_finite(seq, f"{where}.advantage", item.get("advantage")),
        "length": length,
        "finish_reason": _text(seq, item, "finish_reason", required=False, where=where)[:32],
        "extra": dict(extra),
    }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(seq: int, event: Mapping[str, Any], field: str, where: str = "") -> Any:
    if field not in event:
        raise InvalidEvent(seq, f"{where}.{field}" if where else field, "is missing")
    return event[field]


def _text(seq: int, event: Mapping[str, Any], field: str, *, required: bool = True, where: str = "") -> str:
    value = _require(seq, event, field, where) if required else event.get(field, "")
    value = "" if value is None and not required else value
    if not isinstance(value, str):
        raise InvalidEvent(seq, f"{where}.{field}" if where else field, f"must be a string, got {value!r}")
    # PostgreSQL text cannot hold NUL; the engine never means one.
    return value.replace("\x00", "")


def _step(seq: int, event: Mapping[str, Any]) -> int:
    step = _require(seq, event, "step")
    if not _is_int(step) or step < 0 or step > 2**31 - 1:
        raise InvalidEvent(seq, "step", f"must be an integer in [0, 2^31), got {step!r}")
    return step


def _finite(seq: int, field: str, value: object) -> float:
    if _is_int(value) or isinstance(value, float):
        number = float(value)  # type: ignore[arg-type]
        if math.isfinite(number):
            return number
    raise InvalidEvent(seq, field, f"must be a finite number, got {value!r}")


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


def _store(run: Run, fresh: list[dict[str, Any]]) -> None:
    now = timezone.now()
    points: list[PointRow] = []
    samples: list[Sample] = []
    checkpoints: list[Checkpoint] = []
    logs: list[LogLine] = []
    summary = dict(run.summary)
    last_step = run.last_step

    for event in fresh:
        seq, kind = event["seq"], event["type"]
        if kind == "metrics":
            for name, value in event["values"].items():
                points.append((run.pk, name, event["step"], value, event["time"], seq))
                summary[name] = value
            last_step = max(last_step, event["step"])
        elif kind == "samples":
            samples.extend(
                Sample(run=run, step=event["step"], seq=seq, index=i, **item)
                for i, item in enumerate(event["items"])
            )
        elif kind == "checkpoint":
            checkpoints.append(
                Checkpoint(run=run, seq=seq, step=event["step"], path=event["path"], bytes=event["bytes"])
            )
        elif kind == "log":
            logs.append(LogLine(run=run, seq=seq, level=event["level"], message=event["message"], time=now))
        elif kind == "status":
            refused = _apply_status(run, event["state"], event["message"])
            if refused:
                logs.append(LogLine(run=run, seq=seq, level=LogLevel.WARNING, message=refused, time=now))

    # ignore_conflicts: a row already stored (the same event under an older cursor, or a
    # resumed run recomputing a step) keeps its first value.
    insert_metric_points(points)
    Sample.objects.bulk_create(samples, batch_size=500, ignore_conflicts=True)
    Checkpoint.objects.bulk_create(checkpoints, ignore_conflicts=True)
    LogLine.objects.bulk_create(logs, batch_size=1000, ignore_conflicts=True)
    Run.objects.filter(pk=run.pk).update(
        last_seq=fresh[-1]["seq"], last_step=last_step, summary=summary, heartbeat_at=now
    )


def _apply_status(run: Run, state: str, message: str) -> str:
    """Apply an engine status event; return why it was refused ("" when applied or repeated)."""
    target = RunStatus(state)
    if run.status == target:
        return ""
    if not RunStatus(run.status).can_become(target):
        return f"status {state!r} from the engine not applied: the run is {run.status!r}" + (
            f" ({message})" if message else ""
        )
    # The row is locked by store_events, so this conditional update cannot lose a race.
    run.transition(target, message=message)
    return ""
