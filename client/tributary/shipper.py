"""At-least-once shipping of a run's JSONL event log to the web app's ingest socket.

One ``EventShipper`` per run, in its own thread, speaking ``client/tributary/protocol.py`` with a
``websockets`` sync client:

- It tails the engine's event log (``EventLog``): only lines ending with a newline count, so
  a torn last line is shipped once the engine completed it; lines that are not JSON events
  (the remains of a line torn by a crash) are skipped.
- Batches of consecutive events (at most ``MAX_BATCH_EVENTS`` and under ``MAX_MESSAGE_BYTES``
  each), the next starting after the last one sent. While the log holds a backlog (the batch
  out was cut at a limit, not at the end of the log), up to ``window`` (3) are out at once: the
  next is read from the log, sent and received while the ones before are in the web app's
  database (issue 19: stop-and-wait left the web app idle between batches). Three, since the web
  app stores two at once on PostgreSQL (``IngestConsumer._pump``): the third is read and decoded
  by then and starts when the first is answered, where with two out it was only sent then
  (``bench/ingest.py``: ratio to COPY 0.93 -> 1.01 median over 15 rounds). A batch that
  emptied the log (a live trickle) is stop-and-wait: what is written while it is out goes in
  one batch after its ack, so a trickle is batched at the web app's pace (a second batch of
  one event out at once costs the web app a transaction more, and measured a worse live
  latency, bench/ingest.py). The web app answers every batch with one ack, in order, carrying
  its cursor (cumulative). An ack short of its batch's last seq (the web app asks for a
  resend, or stored no further than an engine's final status) stops the sending until the
  batches still out are answered; the next batch then starts after the last ack. After a
  reconnect it starts after ``hello.last_seq``: what was out unacked is sent again.
  ``EventLog`` keeps a sparse seq -> byte offset index, so resending from any seq reads a
  bounded stretch of the file, however long the run.
- Any connection error, an ack missing ``ack_timeout`` seconds after its batch was sent, or a
  non-fatal close code: reconnect with exponential backoff and jitter (``backoff_delay``), the
  backoff starting over after each ``hello``. A close code in ``FATAL_CLOSE_CODES`` stops the
  shipper with ``ShipperFatal`` in ``error``: reconnecting cannot help.
- Each connection: ``hello`` first, then ``attach`` (on every connection, so a restarted web
  app knows again which worker holds the run), then batches. With a ``claim`` id and a web app
  that grants claims (``hello`` says so), ``attach`` carries the claim and nothing is shipped
  before the web app's ``claim`` answer: a lost claim ends the shipper (``claim_lost``), since
  another supervisor holds the run and this one must not touch it. So does a claim lost later
  (close ``CLOSE_CLAIM_LOST``: a copy of an external run's script took the run over while this
  one was silent).
- Tokens: ``hello`` and ``ack`` may carry a fresh token, used for the next connection.
- Waiting for the log to grow (``_idle``): a writer in the same process (``tributary.Run``'s
  writer thread, an in-process ``EventSink``) calls ``wake()`` after each write, and the shipper
  (built with ``woken=True``) waits on that ``threading.Event``: no poll stands between a write
  and its batch. A writer in another process (the engine, under ``jobs.supervisor``) is polled,
  every ``poll_min`` seconds at first, then less often as the log stays quiet: the wait is at
  most ``poll_fraction`` of the time since the log last grew, bounded to
  [``poll_min``, ``poll_interval``]. Events at 20 Hz are so polled every 5 ms (about 200 cheap
  ``readline`` calls a second, bench/ingest.py measures the thread's CPU), an idle log every
  50 ms as before; the added latency stays under ``poll_fraction`` of the gap between events.
  (inotify would need ctypes or a dependency, Linux only, and a fallback poll anyway for
  network file systems; the bounded poll is portable and its cost measured.)
- ``ping`` when nothing was sent for ``ping_interval`` seconds; ``cancel`` (and a ``hello``)
  go to the owner through callbacks called from the shipper thread.
- The engine's own output (``output``: an ``OutputLog`` over ``engine.log``, set by the owner once
  the engine starts) goes in ``output`` chunks between event batches, events first, with its own
  byte cursor: where ``hello`` says the web app's copy of this file ends (else where this engine's
  output begins), then each ``output_ack``. Draining ships its last line even without a newline.
"""

from __future__ import annotations

import base64
import bisect
import collections
import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.exceptions import ConnectionClosed, InvalidURI, WebSocketException
from websockets.sync.client import ClientConnection, connect

from tributary.protocol import (
    ATTACH_CLAIM,
    CLOSE_CLAIM_LOST,
    FATAL_CLOSE_CODES,
    HELLO_CLAIMS,
    HELLO_OUTPUT_OFFSET,
    HELLO_OUTPUT_STREAM,
    INGEST_PATH,
    MAX_BATCH_EVENTS,
    MAX_EVENT_DEPTH,
    MAX_MESSAGE_BYTES,
    MSG_CLAIM,
    OUTPUT_CHUNK_BYTES,
    PING_INTERVAL_S,
    SEQ_AT_START,
)

log = logging.getLogger(__name__)

_BATCH_HEAD = b'{"type":"events","events":['
_BATCH_TAIL = b"]}"
# Room left under MAX_MESSAGE_BYTES for the envelope (the limit is strict: "<").
_ENVELOPE = len(_BATCH_HEAD) + len(_BATCH_TAIL) + 64


class ShipperFatal(RuntimeError):
    """The web app refused this run for good (a close code in ``FATAL_CLOSE_CODES``, or a bad URL)."""

    def __init__(self, code: int | None, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"ingest refused (close code {code}): {reason}" if code else reason)


class _Reconnect(Exception):
    """This connection is no longer useful (no ack in time, an unexpected message): reconnect."""


@dataclass
class Hello:
    """The web app's first message on a connection (see ``client/tributary/protocol.py``)."""

    last_seq: int
    status: str
    cancel: bool
    token: str | None
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Hello:
        try:
            last_seq = int(msg.get("last_seq") or 0)
        except (TypeError, ValueError):
            raise _Reconnect(f"hello with a bad last_seq: {msg.get('last_seq')!r}") from None
        token = msg.get("token")
        return cls(last_seq, str(msg.get("status") or ""), bool(msg.get("cancel")), token or None, msg)


def ingest_url(web_url: str, run_id: int | str) -> str:
    """``ws(s)://host[/prefix]/ws/ingest/<run>/`` from the web app's base URL (http(s) or ws(s)).

    The token travels in the ``Authorization`` header, not the URL, so access logs of the
    web server and proxies never record it."""
    parts = urlsplit(web_url.strip())
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ShipperFatal(
            None, f"the web app URL {web_url!r} is not an http(s):// or ws(s):// URL (set TRIBUTARY_WEB_URL)"
        )
    path = parts.path.rstrip("/") + INGEST_PATH.format(run_id=run_id)
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def backoff_delay(attempt: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with "equal jitter": uniform in [d/2, d], d = min(cap, base * 2**attempt).

    Half the delay is certain, so delays never shrink from one attempt to the next until the
    cap; the random half spreads the reconnects of many workers after a web app restart.
    """
    d = min(cap, base * (2 ** min(attempt, 32)))
    return d / 2 + (rng or random).uniform(0, d / 2)


def oversized_stand_in(seq: int, raw: bytes, run: Any, path: Path) -> bytes:
    """A ``log`` event that keeps ``seq`` in the chain for an event too big for one message."""
    kind = "?"
    with contextlib.suppress(ValueError, AttributeError, RecursionError):
        kind = str(json.loads(raw).get("type", "?"))
    message = (
        f"event {seq} ({kind}, {len(raw)} bytes) is larger than an ingest message may be "
        f"({MAX_MESSAGE_BYTES} bytes) and was not shipped; it is in {path} on the worker"
    )
    event = {"run": run, "seq": seq, "type": "log", "level": "warning", "message": message}
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()


def unreadable_stand_in(seq: int, raw: bytes, run: Any, path: Path, problem: str) -> bytes:
    """A ``log`` event (level error) that keeps ``seq`` in the chain for an event the web app
    could not read (``problem`` says why: nested deeper than ``MAX_EVENT_DEPTH``)."""
    message = f"event {seq} ({len(raw)} bytes) was not shipped: {problem}; it is in {path} on the worker"
    event = {"run": run, "seq": seq, "type": "log", "level": "error", "message": message}
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()


class EventLog:
    """Reads consecutive complete events from a growing JSONL file, from any seq.

    A cursor remembers where the last batch ended, so shipping in order reads each byte once;
    a sparse index (one entry every ``index_every`` events: seq -> byte offset of its line)
    makes resending from an older seq, after a reconnect, seek close to it.
    """

    def __init__(self, path: str | Path, *, index_every: int = 256) -> None:
        self.path = Path(path)
        self.index_every = index_every
        self._fh: Any = None
        self._index_seqs: list[int] = []
        self._index_offsets: list[int] = []
        self._scanned = 0  # bytes of complete lines already seen by the indexer
        self._since_index = 0
        self._cursor: tuple[int, int] | None = None  # (seq of the last event returned, offset after it)
        self.full = False  # the last read stopped at a limit, not at the end of the log: more is there
        self.run: Any = None  # the run id as written in the events (for stand-in events)

    def _open(self) -> Any:
        if self._fh is None and self.path.exists():
            self._fh = self.path.open("rb")
        return self._fh

    def _note(self, offset: int, length: int, seq: int | None) -> None:
        if offset < self._scanned:
            return
        self._scanned = offset + length
        if seq is None:
            return
        if (not self._index_seqs or self._since_index >= self.index_every) and (
            not self._index_seqs or seq > self._index_seqs[-1]
        ):
            self._index_seqs.append(seq)
            self._index_offsets.append(offset)
            self._since_index = 0
        self._since_index += 1

    def _start(self, after_seq: int) -> int:
        if self._cursor is not None and self._cursor[0] == after_seq:
            return self._cursor[1]
        i = bisect.bisect_right(self._index_seqs, after_seq + 1) - 1
        return self._index_offsets[i] if i >= 0 else 0

    def read(
        self, after_seq: int, *, max_events: int = MAX_BATCH_EVENTS, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> list[tuple[int, bytes]]:
        """Up to ``max_events`` complete events with seq > ``after_seq``, in file order, whose
        ``events`` message stays under ``max_bytes``: ``[(seq, raw JSON line), ...]``."""
        fh = self._open()
        if fh is None:
            return []
        out: list[tuple[int, bytes]] = []
        size = _ENVELOPE
        last = after_seq
        fh.seek(self._start(after_seq))
        self.full = True
        while len(out) < max_events:
            offset = fh.tell()
            line = fh.readline()
            if not line.endswith(b"\n"):
                self.full = False
                break  # end of file, or a line the engine has not finished writing
            seq, problem = _inspect(line)
            self._note(offset, len(line), seq)
            if seq is None or seq <= last:
                continue
            raw = line.rstrip(b"\r\n")
            if problem:
                raw = unreadable_stand_in(seq, raw, self.run, self.path, problem)
                log.warning("event %s of %s is %s; shipping a log event instead", seq, self.path, problem)
            if len(raw) + 1 + _ENVELOPE >= max_bytes:
                if out:
                    break  # it goes alone, as the first of the next batch
                raw = oversized_stand_in(seq, raw, self.run, self.path)
                log.warning(
                    "event %s of %s is larger than an ingest message; shipping a log event instead",
                    seq,
                    self.path,
                )
            if size + len(raw) + 1 >= max_bytes:
                break
            if self.run is None:
                self.run = _run_of(raw)
            out.append((seq, raw))
            size += len(raw) + 1
            last = seq
            self._cursor = (seq, fh.tell())
        return out

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class OutputLog:
    """The engine's output file, read in chunks of whole lines from any byte offset of it.

    ``base`` is where this engine's output begins (a file the worker appends to may hold an
    earlier attempt's before it); ``stream`` names the file (host, device, inode), so the web app
    can tell its own copy of this very file from another's. A chunk ends after its last newline;
    a chunk with none goes whole when it is full (a line longer than a chunk is split) or when
    ``final``."""

    def __init__(self, path: str | Path, base: int = 0, *, chunk_bytes: int = OUTPUT_CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.base = base
        self.chunk_bytes = chunk_bytes
        self._waiting: tuple[int, int] | None = None  # (offset, file size) where only a partial line was

    @property
    def stream(self) -> str:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return ""
        return f"{socket.gethostname()[:120]}:{st.st_dev}:{st.st_ino}"

    def read(self, offset: int, *, final: bool = False) -> bytes:
        """The next chunk from stream position ``offset`` (b"" when there is none yet). Polled
        often: the file is read only when it grew since a read found nothing to send."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return b""
        if size <= offset or (not final and self._waiting == (offset, size)):
            return b""
        with self.path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read(self.chunk_bytes)
        cut = data.rfind(b"\n") + 1
        if cut and not final:
            return data[:cut]
        if final or len(data) >= self.chunk_bytes:
            return data
        self._waiting = (offset, size)
        return b""


def _seq_of(line: bytes) -> int | None:
    return _inspect(line)[0]


def _inspect(line: bytes) -> tuple[int | None, str]:
    """A line's seq (None for what is no event: a torn line), and why it cannot be shipped as
    it is ("" when it can): JSON nested deeper than ``MAX_EVENT_DEPTH``, which the web app's
    parser may not read. The engine never writes such a line (``tributary.events.clean``); a
    line from elsewhere keeps its seq in the chain through a stand-in rather than stalling it."""
    try:
        event = json.loads(line)
    except RecursionError:
        match = SEQ_AT_START.match(line)
        return (int(match.group(1)) if match else None), "nested too deeply to parse"
    except ValueError:
        return None, ""
    seq = event.get("seq") if isinstance(event, dict) else None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
        return None, ""
    if nesting(event, MAX_EVENT_DEPTH) > MAX_EVENT_DEPTH:
        return seq, f"nested deeper than {MAX_EVENT_DEPTH} levels"
    return seq, ""


def nesting(value: Any, limit: int | None = None) -> int:
    """How deeply ``value`` nests (a scalar 0, ``{}`` 1), without recursion; with ``limit``, the
    walk stops at the first level past it (bounded work on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if limit is not None and depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _run_of(raw: bytes) -> Any:
    try:
        return json.loads(raw).get("run")
    except (ValueError, AttributeError):
        return None


HelloCallback = Callable[[Hello, bool], bool]
CancelCallback = Callable[[str], None]
ClaimCallback = Callable[[bool, str, bool], None]


class EventShipper:
    """Ships ``events_path`` to ``<web_url>/ws/ingest/<run_id>/`` from a thread; see the module docstring.

    ``on_hello(hello, first)`` is called for every ``hello``; returning False closes the socket
    without ``attach`` and ends the shipper (the owner decided not to run). ``on_cancel(message)``
    is called for every ``cancel`` message. ``on_claim(won, message, first)`` is called with the
    web app's answer to each claiming ``attach`` (only with ``claim`` and a web app that grants
    claims). All run in the shipper thread.
    """

    def __init__(
        self,
        web_url: str,
        run_id: int | str,
        token: str,
        events_path: str | Path,
        *,
        on_hello: HelloCallback | None = None,
        on_cancel: CancelCallback | None = None,
        on_claim: ClaimCallback | None = None,
        claim: str | None = None,
        attach: dict[str, Any] | None = None,
        ping_interval: float = PING_INTERVAL_S,
        poll_interval: float = 0.05,
        poll_min: float = 0.005,
        poll_fraction: float = 0.1,
        woken: bool = False,
        ack_timeout: float = 120.0,
        open_timeout: float = 10.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 10.0,
        max_batch_events: int = MAX_BATCH_EVENTS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        window: int = 3,
        rng: random.Random | None = None,
    ) -> None:
        self.web_url = web_url
        self.run_id = run_id
        self.token = token
        self.log = EventLog(events_path)
        self.on_hello = on_hello
        self.on_cancel = on_cancel
        self.on_claim = on_claim
        self.claim = claim
        self.attach = attach if attach is not None else {"host": socket.gethostname(), "pid": os.getpid()}
        self.ping_interval = ping_interval
        self.poll_interval = poll_interval
        self.poll_min = min(poll_min, poll_interval)
        self.poll_fraction = poll_fraction
        # The owner calls wake() after every write (same process): wait for it, not a fast poll.
        self.woken = woken
        self.ack_timeout = ack_timeout
        self.open_timeout = open_timeout
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.max_batch_events = max_batch_events
        self.max_message_bytes = max_message_bytes
        self.window = max(1, window)  # batches out unacked at once (1: stop-and-wait)
        self.rng = rng or random.Random()

        self.acked_seq = 0  # the web app's cursor as last heard (hello.last_seq or an ack)
        self.connections = 0  # connections that got as far as a hello
        self.backoff_delays: list[float] = []  # every delay slept before a reconnect, in order
        self.error: ShipperFatal | None = None
        self.declined = False  # on_hello returned False
        self.claim_lost = ""  # the web app's reason, when it gave the run to another claim
        self.drained = False  # finish() was called and everything was acked
        self.gave_up = False  # the drain timeout passed first
        self.last_error_message = ""  # the last ``error`` message the web app sent
        self.quarantined: list[int] = []  # seqs the web app could not store (ack.quarantined)
        self.output: OutputLog | None = None  # the engine's output, once the owner started it
        self.output_acked: int | None = None  # the web app's output cursor in ``output``'s file
        # (stream, offset) the web app said it holds; None: it takes no output
        self._output_hello: tuple[str, int] | None = None
        self.done = threading.Event()
        # Counters (cheap, read by tests and bench/ingest.py): reads of the log that found nothing
        # with no batch out (each followed by a wait for the log), and such waits ended by wake()
        # before their timeout.
        self.empty_reads = 0
        self.wakeups = 0

        self._stop = threading.Event()
        self._finishing = threading.Event()
        self._deadline: float | None = None
        self._last_sent = 0.0
        self._wake = threading.Event()
        self._grew_at = time.monotonic()  # when a read last found events: the poll slows from there
        # This connection's batches out: (last seq, when sent), oldest first; the last seq sent;
        # and whether an ack fell short of its batch (send nothing until the rest are answered).
        self._out: collections.deque[tuple[int, float]] = collections.deque()
        self._sent_seq = 0
        self._resync = False
        self._thread = threading.Thread(target=self._main, name=f"shipper-{run_id}", daemon=True)

    # -- owner's side ----------------------------------------------------------------------

    def start(self) -> EventShipper:
        self._thread.start()
        return self

    def wake(self) -> None:
        """The log grew (called by a writer in this process after its flush): ship it now.

        Cheap and thread-safe (one ``threading.Event.set``); a wake while a batch is out is kept
        and read as soon as the ack came."""
        self._wake.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop now (close the socket), whatever is left to ship."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def finish(self, timeout: float) -> bool:
        """The log is complete: ship what is left, then close. Gives up after ``timeout`` seconds
        (the log stays on disk). Returns whether everything was acked."""
        self._deadline = time.monotonic() + timeout
        self._finishing.set()
        self._wake.set()
        self._thread.join(timeout + self.open_timeout + 10)
        if self._thread.is_alive():
            self.stop()
        return self.drained

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------

    def _main(self) -> None:
        attempt = 0
        try:
            while not self._stop.is_set() and not self._gave_up():
                before = self.connections
                try:
                    self._session()
                    return
                except ShipperFatal as exc:
                    self.error = exc
                    log.error("run %s: stopped shipping events: %s", self.run_id, exc)
                    return
                except (OSError, TimeoutError, WebSocketException, _Reconnect) as exc:
                    code = _close_code(exc)
                    if code in FATAL_CLOSE_CODES:
                        reason = self.last_error_message or _close_reason(exc) or "no reason given"
                        self.error = ShipperFatal(code, reason)
                        if code == CLOSE_CLAIM_LOST:  # as a claim lost at attach (the client: RunRefused)
                            self.claim_lost = reason
                        log.error("run %s: stopped shipping events: %s", self.run_id, self.error)
                        return
                    if self._stop.is_set() or self._gave_up():
                        return
                    if self.connections > before:
                        attempt = 0  # a hello came through: the next outage starts a new backoff
                    delay = backoff_delay(attempt, base=self.backoff_base, cap=self.backoff_cap, rng=self.rng)
                    attempt += 1
                    self.backoff_delays.append(delay)
                    log.warning(
                        "run %s: ingest connection to %s lost (%s); reconnecting in %.1f s (attempt %d)",
                        self.run_id,
                        self.web_url,
                        _describe(exc),
                        delay,
                        attempt,
                    )
                    self._stop.wait(min(delay, self._time_left()))
                except Exception as exc:  # a bug: stop clearly rather than die silently
                    log.exception("run %s: the shipper failed", self.run_id)
                    self.error = ShipperFatal(None, f"the event shipper failed: {exc!r}")
                    return
        finally:
            self.log.close()
            self.done.set()

    def _time_left(self) -> float:
        return float("inf") if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _gave_up(self) -> bool:
        if self._deadline is None or time.monotonic() < self._deadline:
            return False
        if not self.gave_up:
            self.gave_up = True
            log.error(
                "run %s: gave up shipping after the drain timeout; events after seq %d were not acked "
                "and stay in %s",
                self.run_id,
                self.acked_seq,
                self.log.path,
            )
        return True

    def _session(self) -> None:
        url = ingest_url(self.web_url, self.run_id)
        try:
            ws = connect(
                url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                open_timeout=self.open_timeout,
                close_timeout=5,
                max_size=MAX_MESSAGE_BYTES,
                legacy=True,
            )
        except InvalidURI as exc:
            raise ShipperFatal(None, f"bad web app URL {self.web_url!r}: {exc}") from None
        self.last_error_message = ""
        with ws:
            try:
                self._converse(ws)
            except ConnectionClosed:
                self._drain(ws)
                raise

    def _converse(self, ws: ClientConnection) -> None:
        """One connection, from its hello on (``_session``)."""
        self._last_sent = time.monotonic()
        hello = self._wait_hello(ws)
        first = self.connections == 0
        self.connections += 1
        self.acked_seq = hello.last_seq
        offset, stream = hello.raw.get(HELLO_OUTPUT_OFFSET), hello.raw.get(HELLO_OUTPUT_STREAM)
        usable = isinstance(offset, int) and not isinstance(offset, bool) and isinstance(stream, str)
        self._output_hello = (stream, offset) if usable else None
        self.output_acked = None
        if self.on_hello is not None and not self.on_hello(hello, first):
            self.declined = True
            ws.close()
            return
        if self.claim and hello.raw.get(HELLO_CLAIMS):
            self._send(ws, {"type": "attach", **self.attach, ATTACH_CLAIM: self.claim})
            won, why = self._wait_claim(ws)
            if self.on_claim is not None:
                self.on_claim(won, why, first)
            if not won:
                self.claim_lost = why or "the web app gave the run to another claim"
                log.warning("run %s: claim lost: %s", self.run_id, self.claim_lost)
                ws.close()
                return
        else:
            self._send(ws, {"type": "attach", **self.attach})
        self._ship(ws)

    def _ship(self, ws: ClientConnection) -> None:
        self._out.clear()
        self._sent_seq, self._resync = self.acked_seq, False
        while True:
            if self._stop.is_set():
                ws.close()
                return
            if self._gave_up():
                ws.close()
                return
            # Cleared before the read: a write after it sets the event again, so no wake is lost.
            self._wake.clear()
            # Another batch while one is out only from a backlog (see the module docstring).
            room = not self._resync and (not self._out or (len(self._out) < self.window and self.log.full))
            if room:
                batch = self.log.read(
                    self._sent_seq, max_events=self.max_batch_events, max_bytes=self.max_message_bytes
                )
                if batch:
                    message = _BATCH_HEAD + b",".join(raw for _, raw in batch) + _BATCH_TAIL
                    ws.send(message.decode("utf-8"))
                    self._last_sent = self._grew_at = time.monotonic()
                    self._out.append((batch[-1][0], self._last_sent))
                    self._sent_seq = batch[-1][0]
                    continue
            if self._out:  # an ack, or (room for a batch) the log's next read, whichever is first
                self._wait_ack(ws, self._poll_delay() if room else None)
            elif self._ship_output(ws):
                continue
            elif self._finishing.is_set():
                self.drained = True
                log.info("run %s: all events up to seq %d acked", self.run_id, self.acked_seq)
                ws.close()
                return
            else:
                self.empty_reads += 1
                self._idle(ws, self._poll_delay())

    def _ship_output(self, ws: ClientConnection) -> bool:
        """Send the next chunk of the engine's output and wait for its ack; False: nothing to send."""
        output, said = self.output, self._output_hello
        if output is None or said is None:
            return False
        stream = output.stream
        if self.output_acked is None:  # the first chunk of this connection: the web app's copy, or ours
            # The same file (a run resumed on this machine): from where the web app's copy ends, so
            # what a lost engine wrote after its worker died arrives too; another file: our own output.
            self.output_acked = said[1] if said[0] == stream else output.base
        offset = self.output_acked
        data = output.read(offset, final=self._finishing.is_set())
        if not data:
            return False
        encoded = base64.b64encode(data).decode("ascii")
        self._send(ws, {"type": "output", "stream": stream, "offset": offset, "data": encoded})
        deadline = time.monotonic() + self.ack_timeout
        while True:
            left = min(deadline - time.monotonic(), self._time_left())
            if left <= 0 or self._stop.is_set():
                raise _Reconnect(f"no ack for the output from byte {offset}")
            msg = self._recv(ws, min(left, self._until_ping(), 1.0))
            if msg is None:
                self._ping_if_due(ws)
                continue
            if msg.get("type") == "output_ack":
                held = msg.get("offset")
                if not isinstance(held, int) or isinstance(held, bool) or held < 0:
                    raise _Reconnect(f"an output_ack without a usable offset: {msg!r}")
                self.output_acked = held
                return True
            self._handle(msg)

    # -- messages --------------------------------------------------------------------------

    def _drain(self, ws: ClientConnection) -> None:
        """Take what the web app sent before closing that this thread had not read: a send that
        found the socket closed raises before the answers already received are read, and one of
        them may be an ack with a renewed token (``_recv``), which the reconnect must use, or the
        error saying why the web app closed."""
        while True:
            try:
                msg = self._recv(ws, 0)
                if msg is None:
                    return
                self._handle(msg)
            except (ConnectionClosed, _Reconnect):
                return

    def _send(self, ws: ClientConnection, message: dict[str, Any]) -> None:
        ws.send(json.dumps(message, separators=(",", ":")))
        self._last_sent = time.monotonic()

    def _recv(self, ws: ClientConnection, timeout: float) -> dict[str, Any] | None:
        try:
            data = ws.recv(timeout=max(0.0, timeout))
        except TimeoutError:
            return None
        try:
            msg = json.loads(data)
        except ValueError:
            raise _Reconnect(f"the web app sent something that is not JSON: {data[:200]!r}") from None
        if not isinstance(msg, dict):
            raise _Reconnect(f"the web app sent a non-object: {data[:200]!r}")
        if msg.get("token"):
            self.token = str(msg["token"])
        return msg

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "cancel":
            log.info("run %s: the web app asks to cancel: %s", self.run_id, msg.get("message", ""))
            if self.on_cancel is not None:
                self.on_cancel(str(msg.get("message") or "cancelled"))
        elif kind == "error":
            self.last_error_message = str(msg.get("message") or "")
            log.warning(
                "run %s: the web app reports error %s: %s", self.run_id, msg.get("code"), msg.get("message")
            )
        elif kind == "ack":
            self._take_ack(msg)
        else:
            log.warning("run %s: ignoring an unexpected %r message from the web app", self.run_id, kind)

    def _ping_if_due(self, ws: ClientConnection) -> None:
        if time.monotonic() - self._last_sent >= self.ping_interval:
            self._send(ws, {"type": "ping"})

    def _until_ping(self) -> float:
        return max(0.0, self._last_sent + self.ping_interval - time.monotonic())

    def _wait_hello(self, ws: ClientConnection) -> Hello:
        deadline = time.monotonic() + max(self.open_timeout, 30.0)
        while True:
            left = min(deadline - time.monotonic(), self._time_left())
            if left <= 0 or self._stop.is_set():
                raise _Reconnect("no hello from the web app")
            msg = self._recv(ws, left)
            if msg is None:
                continue
            if msg.get("type") == "hello":
                return Hello.parse(msg)
            self._handle(msg)

    def _wait_claim(self, ws: ClientConnection) -> tuple[bool, str]:
        """The web app's answer to a claiming ``attach``: (won, why not)."""
        deadline = time.monotonic() + self.ack_timeout
        while True:
            left = min(deadline - time.monotonic(), self._time_left())
            if left <= 0 or self._stop.is_set():
                raise _Reconnect("no answer to the claim")
            msg = self._recv(ws, min(left, self._until_ping(), 1.0))
            if msg is None:
                self._ping_if_due(ws)
                continue
            if msg.get("type") == MSG_CLAIM:
                return bool(msg.get("won")), str(msg.get("message") or "")
            self._handle(msg)

    def _wait_ack(self, ws: ClientConnection, at_most: float | None) -> None:
        """Wait for the web app's next message (the oldest batch's ack, mostly), or ``at_most``
        seconds (None: until that ack is due); handle it. The ack is overdue ``ack_timeout``
        seconds after its batch was sent: reconnect."""
        seq, sent_at = self._out[0]
        left = min(sent_at + self.ack_timeout - time.monotonic(), self._time_left())
        if left <= 0 or self._stop.is_set():
            raise _Reconnect(f"no ack for the batch up to seq {seq}")
        msg = self._recv(ws, min(left, self._until_ping(), 1.0, at_most if at_most is not None else left))
        if msg is None:
            self._ping_if_due(ws)
        else:
            self._handle(msg)

    def _take_ack(self, msg: dict[str, Any]) -> None:
        """An ``ack``: the answer to the oldest batch out (the web app answers each in order)."""
        try:
            self.acked_seq = seq = int(msg["seq"])
        except (KeyError, TypeError, ValueError):
            raise _Reconnect(f"an ack without a seq: {msg!r}") from None
        quarantined = msg.get("quarantined")
        if isinstance(quarantined, list) and quarantined:
            # Stored as error log lines in their place: the stream goes on.
            self.quarantined.extend(q for q in quarantined if isinstance(q, int))
            log.warning(
                "run %s: the web app could not store events %s and quarantined them (see the "
                "run's Logs tab); they stay in %s",
                self.run_id,
                quarantined,
                self.log.path,
            )
        if not self._out:
            return  # no batch out (the web app's cursor only)
        last, _ = self._out.popleft()
        if seq < last:  # short of the batch: resend from the web app's cursor once all are answered
            self._resync = True
        if self._resync and not self._out:
            self._sent_seq, self._resync = seq, False
        elif seq > self._sent_seq:  # the web app holds more than was sent here (another socket's)
            self._sent_seq = seq

    def _poll_delay(self) -> float:
        """How long to wait before reading the log again (module docstring: woken, or polled at
        most ``poll_fraction`` of the time since the log last grew, within [poll_min, poll_interval])."""
        if self.woken:
            return self.poll_interval
        quiet = time.monotonic() - self._grew_at
        return min(self.poll_interval, max(self.poll_min, self.poll_fraction * quiet))

    def _idle(self, ws: ClientConnection, seconds: float) -> None:
        """Wait for the log to grow, answering the web app and pinging meanwhile.

        Woken: wait on ``wake()`` (messages from the web app, a ``cancel``, are read after it, so
        within ``poll_interval``); else wait on the socket, which returns early for a message."""
        seconds = min(seconds, self._until_ping())
        if self.woken:
            if self._wake.wait(seconds):
                self.wakeups += 1
            while (msg := self._recv(ws, 0)) is not None:
                self._handle(msg)
        elif (msg := self._recv(ws, seconds)) is not None:
            self._handle(msg)
        self._ping_if_due(ws)


def _close_code(exc: BaseException) -> int | None:
    if isinstance(exc, ConnectionClosed) and exc.rcvd is not None:
        return exc.rcvd.code
    return None


def _close_reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionClosed) and exc.rcvd is not None:
        return exc.rcvd.reason
    return ""


def _describe(exc: BaseException) -> str:
    code = _close_code(exc)
    if code is not None:
        reason = _close_reason(exc)
        return f"closed with code {code}" + (f": {reason}" if reason else "")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
