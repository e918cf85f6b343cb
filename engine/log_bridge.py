"""Python's log records and warnings as the run's ``log`` events, and as lines of its stderr.

Libraries (transformers, torch, vLLM, DeepSpeed) speak through ``logging`` and ``warnings``; left
alone, their words go to stderr with no level and never reach the run page. ``LogBridge`` puts a
handler on the root logger (and routes ``warnings`` through ``logging``) for the life of a run:

- each record becomes a ``log`` event (level, ``logger: message``, the traceback included), so the
  Logs tab shows it live and keeps it, filterable by level;
- a chatty library cannot flood the event log: a token bucket lets ``burst`` records through at
  once and ``per_second`` after that; what it holds back is counted per logger and reported in
  one warning event before the next record that passes (and when the run ends);
- libraries already imported that print their records straight to the terminal (transformers
  gives its logger a stderr handler of its own and stops it propagating) are routed here instead
  while the bridge is installed, so their levels are kept. One imported later (vLLM, DeepSpeed)
  keeps printing: its lines reach the page as output, with a level read from their words;
- every record, held back or not, and every message the engine logs itself (``EventSink.log``)
  is also written to stderr as ``MIRROR`` lines: the worker keeps stderr as the run's full
  ``engine.log``, which the page offers for download, so the file has them all. The worker and
  the web app skip these lines when they turn that file into log lines (``is_mirrored``): they
  are on the page already, as events.

Standard library only: the web app imports ``is_mirrored`` without loading torch.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections import Counter
from typing import IO, Any

MAX_MESSAGE_CHARS = 16_000
"""Characters of one record kept in its event (the mirror line in ``engine.log`` keeps all)."""

# One line of the mirror: ``2026-11-26T08:30:00.123Z WARNING transformers.modeling_utils: text``;
# a message of several lines repeats the header on each, so every line of the file says whose it is.
MIRROR = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?:DEBUG|INFO|WARNING|ERROR) [^\s:]{1,200}: ")

_LEVELS = ((logging.ERROR, "error"), (logging.WARNING, "warning"), (logging.INFO, "info"))


def level_name(levelno: int) -> str:
    """A ``logging`` level as one of the protocol's (debug, info, warning, error; critical is error)."""
    return next((name for floor, name in _LEVELS if levelno >= floor), "debug")


def mirror_lines(created: float, level: str, source: str, message: str) -> str:
    """``message`` as ``MIRROR`` lines (with their newlines), stamped with ``created`` (Unix s, UTC)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"
    name = re.sub(r"[\s:]+", "_", source)[:200] or "-"
    header = f"{stamp} {level.upper()} {name}: "
    return "".join(header + line + "\n" for line in message.replace("\r", "").split("\n"))


def is_mirrored(line: str) -> bool:
    """Whether a line of ``engine.log`` is the mirror of a log event (``mirror_lines``)."""
    return MIRROR.match(line) is not None


class TokenBucket:
    """``burst`` at once, then ``per_second``: whether one more record may go out now."""

    def __init__(self, burst: int, per_second: float, clock: Any = time.monotonic) -> None:
        self.burst, self.per_second, self.clock = burst, per_second, clock
        self.tokens = float(burst)
        self.at = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_second)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class LogBridge(logging.Handler):
    """Root-logger handler turning records into log events; see the module docstring.

    ``sink`` is the run's ``EventSink``; ``mirror`` the stream for the ``MIRROR`` lines ("stderr":
    the process's stderr; None for none). Use as a context manager around the run: ``install``
    on enter, ``close`` on exit.
    """

    def __init__(
        self,
        sink: Any,
        *,
        mirror: IO[str] | str | None = "stderr",
        burst: int = 200,
        per_second: float = 10.0,
    ) -> None:
        super().__init__(logging.INFO)
        self.sink = sink
        self.mirror = sys.stderr if mirror == "stderr" else mirror  # this process's stderr as it is now
        self.bucket = TokenBucket(burst, per_second)
        self.suppressed: Counter[str] = Counter()
        self.since = 0.0
        self._busy = threading.local()  # a record logged while handling one is dropped, not looped
        self._saved: tuple[int, Any] | None = None
        self._rerouted: list[tuple[logging.Logger, list[logging.Handler]]] = []
        self.setFormatter(logging.Formatter("%(message)s"))

    # -- lifetime ----------------------------------------------------------------------------

    def install(self) -> LogBridge:
        root = logging.getLogger()
        self._saved = (root.level, self.sink.on_log)
        root.addHandler(self)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)
        logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> here
        self.sink.on_log = self.write_mirror  # the engine's own log events reach engine.log too
        self._reroute_terminal_loggers()
        return self

    def _reroute_terminal_loggers(self) -> None:
        """Loggers that do not propagate and print to a stream of their own (a library's
        terminal output) propagate here instead, their stream handlers set aside until ``close``."""
        for logger in list(logging.Logger.manager.loggerDict.values()):
            if not isinstance(logger, logging.Logger) or logger.propagate:
                continue
            printers = [
                h
                for h in logger.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            ]
            if printers:
                for handler in printers:
                    logger.removeHandler(handler)
                logger.propagate = True
                self._rerouted.append((logger, printers))

    def close(self) -> None:
        if self._saved is not None:
            self.report_suppressed()
            root = logging.getLogger()
            root.removeHandler(self)
            root.setLevel(self._saved[0])
            logging.captureWarnings(False)
            for logger, printers in self._rerouted:
                logger.propagate = False
                for handler in printers:
                    logger.addHandler(handler)
            self._rerouted.clear()
            self.sink.on_log = self._saved[1]
            self._saved = None
        super().close()

    def __enter__(self) -> LogBridge:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records -----------------------------------------------------------------------------

    def write_mirror(self, level: str, source: str, message: str, created: float | None = None) -> None:
        if self.mirror is None:
            return
        try:
            self.mirror.write(
                mirror_lines(time.time() if created is None else created, level, source, message)
            )
            self.mirror.flush()
        except (OSError, ValueError):  # a closed or broken stderr must not stop the run
            pass

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            try:
                message = self.format(record)
            except Exception:  # a record whose arguments do not format: say so rather than lose it
                message = f"{record.msg!r} (its arguments did not format: {record.args!r})"
            level = level_name(record.levelno)
            self.write_mirror(level, record.name, message, record.created)
            with self.sink.hold():
                if not self.bucket.take():
                    if not self.suppressed:
                        self.since = record.created
                    self.suppressed[record.name] += 1
                    return
                self.report_suppressed()
                self.sink.emit("log", level=level, message=f"{record.name}: {message}"[:MAX_MESSAGE_CHARS])
        finally:
            self._busy.on = False

    def report_suppressed(self) -> None:
        """One warning event for the records held back since the last report (if any)."""
        if not self.suppressed:
            return
        total = sum(self.suppressed.values())
        who = ", ".join(f"{name} {count}" for name, count in self.suppressed.most_common(5))
        more = len(self.suppressed) - 5
        self.suppressed.clear()
        self.sink.emit(
            "log",
            level="warning",
            message=(
                f"{total} log records since {time.strftime('%H:%M:%S', time.gmtime(self.since))} UTC were not sent "
                f"to the page (more than {self.bucket.burst} at once or {self.bucket.per_second:g} a second): "
                f"{who}{f' and {more} more loggers' if more > 0 else ''}. The full log (engine.log) has them."
            ),
        )
