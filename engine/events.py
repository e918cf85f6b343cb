"""The engine's event stream: the JSONL protocol of ARCHITECTURE.md.

The writer (``EventSink``) and its rules (``clean``: strict, storable JSON) are
``tributary.events``, shared with the client library; this module adds the engine's heartbeat.
"""

from __future__ import annotations

import threading

# The writing rules live in the client library (standard library only), so a user's own training
# script writes its log exactly as the engine does; re-exported here for the engine's modules.
from tributary.events import (  # noqa: F401 - re-exported
    DEPTH_MARK,
    MAX_DEPTH,
    REPLACEMENT,
    EventSink,
    clean,
    clean_text,
    encode,
    last_seq_in,
)


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
