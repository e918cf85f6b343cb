"""The engine's event stream: the JSONL protocol of DESIGN.md.

Every event is one JSON object per line with ``run``, ``seq`` (1, 2, 3, ... never reused,
also across a resume) and ``type`` (status, metrics, samples, checkpoint, log, heartbeat).
The engine's own log is the source of truth that the worker ships to the web app, so each
line is written whole and flushed (and fsynced for events that must survive a crash:
status and checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Literal

EventType = Literal["status", "metrics", "samples", "checkpoint", "log", "heartbeat"]
RunState = Literal["starting", "running", "succeeded", "failed", "cancelled"]
EVENT_TYPES: tuple[str, ...] = ("status", "metrics", "samples", "checkpoint", "log", "heartbeat")


def last_seq_in(path: Path) -> int:
    """Highest ``seq`` in an existing JSONL log (0 if none). A torn last line is ignored."""
    if not path.exists():
        return 0
    last = 0
    with path.open("rb") as fh:
        for raw in fh:
            try:
                last = max(last, int(json.loads(raw)["seq"]))
            except (ValueError, KeyError, TypeError):
                continue
    return last


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    # JSON has no NaN/inf; a non-finite metric is sent as null rather than breaking the line.
    return {k: (float(v) if math.isfinite(float(v)) else None) for k, v in values.items()}


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
            self._repair_torn_tail(path)
            self._fh = path.open("a", encoding="utf-8")
            self._own = True
        else:
            self._fh = target
        self.seq = start_seq

    @staticmethod
    def _repair_torn_tail(path: Path) -> None:
        # A crash mid-write can leave a line without its newline; start on a fresh line.
        if path.exists() and path.stat().st_size:
            with path.open("rb+") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")

    def hold(self) -> threading.RLock:
        """Hold the sink (``with sink.hold():``) so no other thread takes a seq meanwhile: a
        checkpoint records the seq its own event will get."""
        return self._lock

    def emit(self, type: EventType, durable: bool = False, **fields: Any) -> int:
        with self._lock:
            self.seq += 1
            event = {"run": self.run_id, "seq": self.seq, "type": type, **fields}
            if self._fh is not None:
                self._fh.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
                self._fh.flush()
                if durable and self._own:
                    os.fsync(self._fh.fileno())
            return self.seq

    # One method per event type, so call sites read as the protocol table.
    def status(self, state: RunState, message: str = "") -> int:
        return self.emit("status", durable=True, state=state, message=message)

    def metrics(self, step: int, values: dict[str, float]) -> int:
        return self.emit("metrics", step=step, time=time.time(), values=_finite(values))

    def samples(self, step: int, items: list[dict[str, Any]]) -> int:
        return self.emit("samples", step=step, items=items)

    def checkpoint(self, step: int, path: str, nbytes: int) -> int:
        return self.emit("checkpoint", durable=True, step=step, path=path, bytes=nbytes)

    def log(self, level: str, message: str) -> int:
        return self.emit("log", level=level, message=message)

    def heartbeat(self) -> int:
        return self.emit("heartbeat", time=time.time())

    def close(self) -> None:
        with self._lock:
            if self._own and self._fh is not None:
                self._fh.close()
            self._fh = None


class Heartbeat:
    """Emits a heartbeat every ``interval`` seconds from a daemon thread while a run lives."""

    def __init__(self, sink: EventSink, interval: float) -> None:
        self._sink = sink
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sink.heartbeat()

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
