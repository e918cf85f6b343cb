"""The engine's heartbeat on its event stream (the JSONL protocol of ARCHITECTURE.md).

The writer (``EventSink``) and its rules (``clean``: strict, storable JSON) are
``tributary.events``, shared with the client library, and imported from there.
"""

from __future__ import annotations

import threading

from tributary.events import EventSink


class EventHeartbeat:
    """Emits a heartbeat event every ``interval`` seconds from a daemon thread while a run lives."""

    def __init__(self, sink: EventSink, interval: float) -> None:
        self._sink = sink
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sink.heartbeat()

    def __enter__(self) -> EventHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
