"""The event log's writing rules, shared by Tributary's engine and its client library.

Every event is one JSON object per line with ``run``, ``seq`` (1, 2, 3, ... never reused, also
across a resume) and ``type`` (status, metrics, samples, checkpoint, log, heartbeat; the fields
are in ARCHITECTURE.md's protocol table and ``engine.contracts``). The log is the source of
truth that a shipper sends to the web app, so each line is written whole and flushed (and
fsynced for events that must survive a crash: status and checkpoint), as strict JSON that the
web app can store (``clean``). Standard library only: the engine (``engine.run``, ``jobs.supervisor``)
and a user's training script (``tributary.Run``) write through the same code.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tributary.protocol import SEQ_AT_START

FINAL_STATES = ("succeeded", "failed", "cancelled")


@dataclass
class LogState:
    """What an existing event log holds, for whoever goes on writing or shipping it."""

    last_seq: int = 0
    last_step: int = -1  # of a metrics or samples event
    metrics_step: int = -1  # of a metrics event
    samples_per_step: dict[int, int] = field(default_factory=dict)  # items of samples events
    final_state: str = ""  # the last status event's state when final, else ""


def scan_log(path: Path) -> LogState:
    """One pass over a JSONL event log (``LogState``; all zero when there is none). Torn or bad
    lines are no events and are skipped."""
    state = LogState()
    if not path.exists():
        return state
    status = ""
    with path.open("rb") as fh:
        for raw in fh:
            try:
                event = json.loads(raw)
                state.last_seq = max(state.last_seq, int(event["seq"]))
                kind = event.get("type")
                if kind == "metrics":
                    step = int(event["step"])
                    state.metrics_step = max(state.metrics_step, step)
                    state.last_step = max(state.last_step, step)
                elif kind == "samples":
                    step = int(event["step"])
                    state.last_step = max(state.last_step, step)
                    state.samples_per_step[step] = state.samples_per_step.get(step, 0) + len(event["items"])
                elif kind == "status":
                    status = str(event.get("state") or "")
            except RecursionError:  # nested past what the parser reads: the seq is at the start
                match = SEQ_AT_START.match(raw)
                state.last_seq = max(state.last_seq, int(match.group(1))) if match else state.last_seq
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    state.final_state = status if status in FINAL_STATES else ""
    return state


def last_seq_in(path: Path) -> int:
    """Highest ``seq`` in an existing JSONL log (0 if none). A torn last line is ignored."""
    return scan_log(path).last_seq


def repair_torn_tail(path: Path) -> None:
    """A crash mid-write can leave a line without its newline: end it, so the next event starts
    on a fresh line (the torn line is no event; shippers skip it)."""
    if path.is_file() and path.stat().st_size:
        with path.open("rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    # JSON has no NaN/inf; a non-finite metric is sent as null rather than breaking the line.
    return {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}


# --- storable text -----------------------------------------------------------------------
# The web app stores events in PostgreSQL, whose text and jsonb cannot hold NUL, and no UTF-8
# encoder can write a lone surrogate (``"\ud800"`` from a ``\ud800`` escape in a dataset row):
# the line would break the log or the ingest of the whole run. Both become U+FFFD, Unicode's
# own mark for "a character was here that could not be represented", so what was replaced
# stays visible. The web app applies the same function to what it receives (``clean``).

REPLACEMENT = "\ufffd"
MAX_DEPTH = 32
DEPTH_MARK = f"<nested deeper than {MAX_DEPTH} levels: dropped>"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with NUL and lone surrogates replaced by U+FFFD (unchanged when it has none)."""
    return _UNSTORABLE.sub(REPLACEMENT, text) if _UNSTORABLE.search(text) else text


def encode(event: dict[str, Any]) -> str:
    """One event as its JSONL line (without the newline): ``clean``, then ``dumps``."""
    return dumps(clean(event))


def dumps(event: dict[str, Any]) -> str:
    """Strict, compact JSON of an event already ``clean`` (or checked as strictly by its writer)."""
    return json.dumps(event, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def clean(value: Any, depth: int = 1) -> Any:
    """``value`` as strict, storable JSON data: text (keys too) through ``clean_text``,
    non-finite floats as null (JSON has no NaN), tuples as lists, anything below ``MAX_DEPTH``
    levels of nesting replaced by ``DEPTH_MARK``, other objects by their ``str``.

    Depth is bounded because parsers recurse: a deeply nested row would otherwise crash the
    worker's or the web app's JSON parser instead of being stored."""
    if isinstance(value, str):
        return clean_text(value)
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict | list | tuple) and depth > MAX_DEPTH:
        return DEPTH_MARK
    if isinstance(value, dict):
        return {clean_text(str(k)): clean(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v, depth + 1) for v in value]
    return clean_text(str(value))


class EventSink:
    """Writes events with strictly increasing ``seq`` to a JSONL file or a stream.

    ``start_seq`` is the last seq already used (from the checkpoint on resume); when the
    target file exists, numbering continues after the larger of the two, so a resumed run
    appends to its log without reusing a number. Thread-safe (the heartbeat thread writes too).
    """

    def __init__(self, run_id: str, target: str | Path | IO[str] | None, *, start_seq: int = 0) -> None:
        self.run_id = run_id
        self._lock = threading.RLock()
        self._own = False
        self._fh: IO[str] | None
        if target is None:
            self._fh = None
        elif target == "-":
            self._fh = sys.stdout
        elif isinstance(target, str | Path):
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            start_seq = max(start_seq, last_seq_in(path))
            repair_torn_tail(path)
            self._fh = path.open("a", encoding="utf-8")
            self._own = True
        else:
            self._fh = target
        self.seq = start_seq
        # Called with (level, source, message) for every ``log`` (engine.log_bridge mirrors
        # them into the engine's stderr, so the run's full log holds them too).
        self.on_log: Callable[[str, str, str], None] | None = None
        # Called after every line is flushed: a shipper in this process (``EventShipper.wake``)
        # ships it at once instead of finding it at its next poll.
        self.on_write: Callable[[], None] | None = None

    def hold(self) -> threading.RLock:
        """Hold the sink (``with sink.hold():``) so no other thread takes a seq meanwhile: a
        checkpoint records the seq its own event will get."""
        return self._lock

    def emit(self, type: str, durable: bool = False, **fields: Any) -> int:
        with self._lock:
            self.seq += 1
            line = encode({"run": self.run_id, "seq": self.seq, "type": type, **fields})
            if self._fh is not None:
                self._fh.write(line + "\n")
                self._fh.flush()
                if durable and self._own:
                    os.fsync(self._fh.fileno())
                if self.on_write is not None:
                    self.on_write()
            return self.seq

    # One method per event type, so call sites read as the protocol table.
    def status(self, state: str, message: str = "") -> int:
        return self.emit("status", durable=True, state=state, message=message)

    def metrics(self, step: int, values: dict[str, float]) -> int:
        return self.emit("metrics", step=step, time=time.time(), values=_finite(values))

    def samples(self, step: int, items: list[dict[str, Any]]) -> int:
        return self.emit("samples", step=step, items=items)

    def checkpoint(self, step: int, path: str, nbytes: int, deleted: Sequence[str] = ()) -> int:
        """``deleted``: the paths of earlier checkpoints this one's save removes (``keep_last``,
        or a branch a rewind left), so the web app stops offering them to resume from."""
        return self.emit("checkpoint", durable=True, step=step, path=path, bytes=nbytes, deleted=list(deleted))

    def log(self, level: str, message: str) -> int:
        if self.on_log is not None:
            self.on_log(level, "engine", message)
        return self.emit("log", level=level, message=message)

    def heartbeat(self) -> int:
        return self.emit("heartbeat", time=time.time())

    def close(self) -> None:
        with self._lock:
            if self._own and self._fh is not None:
                self._fh.close()
            self._fh = None
