"""A training script's run: ``tributary.init(...)`` and the ``Run`` it returns.

Offline first. Every call appends an event of the engine's protocol (ARCHITECTURE.md's table:
``run``, ``seq`` 1, 2, 3, ..., ``type``) to ``<dir>/events.jsonl``; ``<dir>/run.json`` holds
what is needed to create the run on the server later (project, name, config, tags, the web app's
URL, the run's ``client_id``) and, once known, the server's run id. The log is the source of
truth: when the server is down the events wait on disk, and ``python -m tributary sync DIR``
ships them later.

Three threads, so the training loop only pays for a snapshot of its values:

- the caller's thread takes a snapshot of the values (a copy of the metrics dict, whose numbers
  that are not plain ``float``/``int``, a tensor say, are read now; samples' text and extras
  copied) and appends it to a bounded in-memory queue, taking the next ``seq`` only when the
  event is queued, so the log's seqs stay consecutive (the web app stores a run's events in seq
  order, with no gap);
- the writer thread checks metric names and numbers, encodes the events
  (``tributary.events.encode``: the engine's own rules, strict storable JSON) and appends whole
  lines to ``events.jsonl``, fsyncing status events;
- the link thread creates the server run (``POST /api/runs/external``, retried with backoff,
  idempotent through ``client_id``), then runs the worker's own at-least-once shipper
  (``tributary.shipper.EventShipper``: acks, resend after the last ack, backoff), which tails
  the file. A ``cancel`` from the web app (or ``hello.cancel`` on a reconnect) sets the flag
  ``should_stop()`` returns.

Drop policy: the queue holds at most ``max_queue_events`` events and about ``max_queue_bytes``
of values. When the writer falls that far behind (a stalled disk), a call drops its event and
counts it in ``dropped_events`` (one warning in the log) instead of waiting: the training loop
never waits on the client for longer than a lock held while a list is swapped. Values the
protocol cannot carry (non-numeric metrics, names that are not 1-200 characters of text, a step
outside [0, 2^31)) are skipped and counted in ``skipped_values``. No call of a ``Run`` raises
because of logging: its errors are logged once per kind and counted in ``errors``.

One script per run. Two scripts with one ``client_id`` (a run directory copied to another host,
or path, and resumed in both) would send the same seqs, and the web app keeps the first event of
each: the second's would be dropped. So each ``Run`` ships under a claim (``script_claim``: the
lineage kept in ``run.json``, the place where this process writes the log), and the web app gives
no token to a script while another holds the run (``webapp.runs.external``). A resumed run asks
once in ``init`` (a script the web app refuses raises ``RunRefused`` there, having written
nothing); a refusal heard later (the web app was out of reach at ``init``) makes the next ``log``,
``log_samples`` or ``log_text`` raise it, and ``should_stop()`` true: the user learns it from an
exception, not a log line. A restart in the same directory keeps the run and ships from its ack.

At exit (``finish``, the context manager, or the interpreter's exit for a run never finished)
the client drains: the writer empties the queue, the shipper sends what the web app has not
acknowledged, within ``TRIBUTARY_DRAIN_S`` seconds (default 30); what is left unsent is printed
to stderr with the command that sends it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import math
import operator
import os
import re
import shlex
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tributary.api import Api, ApiError, ServerRun, check_url
from tributary.events import (
    FINAL_STATES,
    LogState,
    clean,
    clean_text,
    dumps,
    encode,
    repair_torn_tail,
    scan_log,
)
from tributary.protocol import CLOSE_BAD_TOKEN, CLOSE_RUN_OVER, FATAL_CLOSE_CODES, script_claim
from tributary.shipper import EventShipper, Hello, backoff_delay

try:
    import fcntl
except ImportError:  # not POSIX: one writer per run directory is then the user's to keep
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("tributary")

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
EVENTS_FILE = "events.jsonl"
DEFAULT_ROOT = "tributary-runs"
DRAIN_ENV = "TRIBUTARY_DRAIN_S"
DEFAULT_DRAIN_S = 30.0
WRITER_GRACE_S = 10.0
# A resumed run's first word with the web app, in ``init``: a refusal (another script holds the
# run) raises there. A web app out of reach waits no longer than this; the link thread retries.
CONTACT_TIMEOUT_S = 5.0
# The worker's shipper, tuned for a script: the writer thread wakes it after each write, so the
# poll (4 times a second) only bounds how late a ``cancel`` from the web app is read.
SHIPPER_DEFAULTS = {"poll_interval": 0.25, "backoff_cap": 30.0}
LOG_LEVELS = ("debug", "info", "warning", "error")

# What the web app stores (webapp/runs/ingest.py): metric names of 1-200 characters, steps and
# lengths in [0, 2^31), text fields up to a million characters.
MAX_NAME = 200
MAX_STEP = 2**31 - 1
MAX_TEXT = 1_000_000
MAX_FINISH_REASON = 32
CUT_MARK = " [... cut by tributary]"
MAX_METRICS_PER_CALL = 10_000
# What the external-runs API takes (webapp/api/schemas.py, webapp/runs/external.py).
MAX_TAGS = 32
MAX_TAG = 50
MAX_CONFIG_BYTES = 256 * 1024
# A samples call is cut into events of about this many bytes, well under an ingest message's 4 MiB.
SAMPLES_EVENT_BYTES = 1024 * 1024
# The bounded queue between the caller and the writer thread.
MAX_QUEUE_EVENTS = 10_000
MAX_QUEUE_BYTES = 64 * 1024 * 1024
# Keys of a sample item that are fields of the protocol's sample; any other key goes to ``extra``.
SAMPLE_KEYS = ("prompt", "completion", "reward", "advantage", "length", "finish_reason", "extra")
# Extra depth as in the whole event: the event 1, items 2, an item 3, extra 4 (ingest's cut too).
EXTRA_DEPTH = 4


class RunRefused(RuntimeError):
    """The web app refused this script its run: another script holds it (the same ``client_id``:
    a copy of this run's directory, running elsewhere). The message names the run, where that
    script reports from, and the fix (a new run). Nothing of this script is stored."""

    def __init__(self, message: str, run_id: int | None = None, held_by: str = "") -> None:
        super().__init__(message)
        self.run_id = run_id
        self.held_by = held_by


def init(project: str = "", **options: Any) -> Run:
    """Start a run: ``init(project, name=, config=, tags=, url=, token=, dir=, resume=)``, the
    arguments of ``Run``. ``url`` and ``token`` default to ``TRIBUTARY_URL`` and
    ``TRIBUTARY_TOKEN``; with no URL at all the run is written offline only (``sync`` later)."""
    return Run(project, **options)


class Run:
    """One run of a training script; see the module docstring for threads and policies.

    ``project``: the project's slug (or ``team-slug/project-slug``). ``dir``: where the run's log
    goes (default ``./tributary-runs/<local id>/``). ``resume``: the directory of an earlier run
    of this script (its ``run.json``) to continue: the same server run, its log appended to with
    the next seqs (``project`` and the other settings come from there). ``drain_s``: the drain
    timeout at exit (default ``TRIBUTARY_DRAIN_S``, else 30 s)."""

    def __init__(
        self,
        project: str = "",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: list[str] | tuple[str, ...] | None = None,
        url: str | None = None,
        token: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        *,
        drain_s: float | None = None,
        max_queue_events: int = MAX_QUEUE_EVENTS,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
        shipper_options: Mapping[str, Any] | None = None,
    ) -> None:
        url = url if url is not None else os.environ.get("TRIBUTARY_URL") or None
        token = token if token is not None else os.environ.get("TRIBUTARY_TOKEN") or None
        if url is None and resume is not None and token:
            url = _meta_url(Path(resume))  # a resumed script sends where it sent before
        self._web_url = check_url(url) if url else None
        self._api = Api(self._web_url, token or "") if self._web_url else None
        self.drain_s = _drain_seconds(drain_s)
        self.max_queue_events = max(1, int(max_queue_events))
        self.max_queue_bytes = max(1, int(max_queue_bytes))
        self._shipper_options = dict(shipper_options or {})

        self._meta_lock = threading.Lock()
        self.resumed_from: LogState | None = None  # what the log held when this process resumed it
        if resume is not None:
            self.dir = Path(resume)
            self.meta = read_meta(self.dir)
            self._dir_lock = _lock_run_dir(self.dir)
            self.resumed_from = scan_log(self.dir / EVENTS_FILE)
            if self.resumed_from.final_state:
                self._dir_lock.close()
                raise ValueError(
                    f"resume={str(resume)!r}: that run already ended ({self.resumed_from.final_state}); "
                    "start a new run instead"
                )
        else:
            if not isinstance(project, str) or not project.strip():
                raise ValueError("project must be the project's slug (its name in the web app's URLs)")
            client_id = str(uuid.uuid4())
            local_id = time.strftime("%Y%m%d-%H%M%S") + "-" + client_id[:8]
            self.dir = Path(dir) if dir is not None else Path(DEFAULT_ROOT) / local_id
            if (self.dir / RUN_FILE).exists():
                raise ValueError(
                    f"dir={str(self.dir)!r} already holds a run: pass resume={str(self.dir)!r} to continue "
                    "it, or another dir"
                )
            self.meta = {
                "project": project.strip(),
                "name": _name(name, local_id),
                "config": _config(config),
                "tags": _tags(tags),
                "url": self._web_url,
                "client_id": client_id,
                "claim": uuid.uuid4().hex,  # the lineage of this directory's scripts (module docstring)
                "local_id": local_id,
                "server_id": None,
                "server_url": None,
                "created": time.time(),
            }
            self.dir.mkdir(parents=True, exist_ok=True)
            self._dir_lock = _lock_run_dir(self.dir)
            self._save_meta()
        self.events_path = self.dir / EVENTS_FILE
        self.client_id: str = self.meta["client_id"]
        self.claim = dir_claim(self.dir, self.meta)
        self.id: int | None = self.meta.get("server_id")
        self.url: str | None = self.meta.get("server_url")
        self.refused: RunRefused | None = None  # the web app gave the run to another script
        # A resumed run asks the web app first, before it writes anything: a copy of its
        # directory may be running elsewhere, and then this script must not start.
        self._contact: ServerRun | ApiError | None = None
        if resume is not None and self._api is not None:
            try:
                self._contact = self._server_run(
                    Api(self._api.url, self._api.token, timeout=CONTACT_TIMEOUT_S)
                )
            except ApiError as exc:
                if exc.held_by is not None:
                    self._dir_lock.close()
                    raise self._refusal(exc) from None
                self._contact = exc  # out of reach, or another refusal: the link thread goes on as ever

        # Counters (read them any time; they only grow).
        self.dropped_events = 0  # the queue was full
        self._skipped = 0  # values the protocol cannot carry, found on the caller's thread
        self._writer_skipped = 0  # ... and on the writer's
        self.errors = 0  # client errors, logged once per kind
        self.link_error = ""  # why the link to the server stopped for good ("" while it works)

        # A resumed run goes on after its log's last seq and, for calls without ``step=``, its last step.
        resumed = self.resumed_from or LogState()
        self._seq, self._step = resumed.last_seq, resumed.last_step
        self.written_seq = self._seq
        self._queue: deque[tuple[int, str, dict[str, Any]]] = deque()
        self._queued_bytes = 0
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the queue: the writer waits here
        self._written = threading.Condition(lock)  # written_seq: flush() waits here
        self._closed = False
        self._finished = False
        self._warned: set[str] = set()
        self._stop_requested = threading.Event()
        self._finishing = threading.Event()
        self._deadline: float | None = None
        self._shipper: EventShipper | None = None

        self._writer = threading.Thread(target=self._write_loop, name="tributary-writer", daemon=True)
        self._writer.start()
        self._link: threading.Thread | None = None
        if self._api is not None:
            self._link = threading.Thread(target=self._link_main, name="tributary-link", daemon=True)
            self._link.start()
        where = f"{Path(sys.argv[0]).name if sys.argv and sys.argv[0] else 'python'} on {socket.gethostname()} (pid {os.getpid()})"
        self._enqueue(
            "status",
            {"state": "running", "message": f"{'resumed' if resume else 'started'}: {where}"},
            200,
            force=True,
        )
        _register_exit(self._at_exit)

    # ------------------------------------------------------------------ the caller's calls

    def log(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Metrics ``{name: number}`` at ``step`` (default: the step after the last one logged,
        0 first). Numbers are anything ``float()`` takes (a 0-d tensor too); NaN and inf travel
        as null, as the engine sends them. Never raises, but ``RunRefused`` once the web app gave
        the run to another script (module docstring)."""
        if self.refused is not None:
            raise self.refused
        try:
            # The caller's thread only takes a snapshot: a copy of the dict, with what is not a
            # plain number (a tensor, a numpy scalar: values that may change after the call)
            # read now. Names and numbers are checked on the writer thread (``_metric_values``).
            snapshot = dict(values)
            if not set(map(type, snapshot.values())) <= _PLAIN_NUMBERS:
                for name, value in snapshot.items():
                    if type(value) not in _PLAIN_NUMBERS:
                        snapshot[name] = _as_float(value)
            out = snapshot
            at = self._take_step(step, advance=True)
            if at is None:
                return
            self._enqueue("metrics", {"step": at, "time": time.time(), "values": out}, 40 * len(out) + 80)
        except Exception as exc:
            self._fault("log", exc)

    def log_samples(self, items: list[Mapping[str, Any]], step: int | None = None) -> None:
        """Rollouts in the engine's sample shape: ``prompt``, ``completion``, ``reward``, and
        optionally ``advantage``, ``length`` (tokens), ``finish_reason``, ``components`` (reward
        components), ``group`` (the prompt's group, so the browser shows a group side by side);
        any other key goes to ``extra``. ``step`` defaults to the last step logged. Never raises,
        but ``RunRefused`` (as ``log``)."""
        if self.refused is not None:
            raise self.refused
        try:
            at = self._take_step(step, advance=False)
            if at is None:
                return
            chunk: list[dict[str, Any]] = []
            size = 0
            for item in items:
                sample = self._sample(item)
                if sample is None:
                    continue
                weight = _sample_bytes(sample)
                if chunk and size + weight > SAMPLES_EVENT_BYTES:
                    self._enqueue("samples", {"step": at, "items": chunk}, size)
                    chunk, size = [], 0
                chunk.append(sample)
                size += weight
            if chunk:
                self._enqueue("samples", {"step": at, "items": chunk}, size)
        except Exception as exc:
            self._fault("log_samples", exc)

    def log_text(self, text: str, level: str = "info") -> None:
        """A line for the run's Logs tab (level debug, info, warning or error). Never raises, but
        ``RunRefused`` (as ``log``)."""
        if self.refused is not None:
            raise self.refused
        try:
            wanted = str(level).lower()
            wanted = "warning" if wanted == "warn" else wanted
            if wanted not in LOG_LEVELS:
                self._warn(
                    "bad-level", f"log_text level {level!r} is not one of {', '.join(LOG_LEVELS)}; using info"
                )
                wanted = "info"
            message = _text(text)
            self._enqueue("log", {"level": wanted, "message": message}, len(message) + 80)
        except Exception as exc:
            self._fault("log_text", exc)

    def should_stop(self) -> bool:
        """Whether someone pressed Cancel on the run's page (or the API's cancel): stop training,
        then ``finish("cancelled")`` (the context manager does when ``should_stop()`` is true)."""
        return self._stop_requested.is_set()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every event queued so far is in ``events.jsonl``; whether it was within
        ``timeout`` seconds. For a caller that keeps its own cursor of what it logged (``follow``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._seq
            while self.written_seq < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._writer.is_alive():
                    return False
                self._written.wait(min(left, 1.0))
        return True

    def finish(self, status: str = "succeeded", message: str = "") -> bool:
        """End the run with a final ``status`` (succeeded, failed, cancelled) and drain: write
        what is queued, ship what the web app has not acknowledged, within the drain timeout.
        Prints what is left unsent, and how to send it. Returns whether everything was shipped
        (always False offline). A second call does nothing."""
        if self._finished:
            return False
        self._finished = True
        try:
            if status not in FINAL_STATES:
                self._warn(
                    "bad-status",
                    f"finish status {status!r} is not one of {', '.join(FINAL_STATES)}; using failed",
                )
                message = message or f"finished with the unknown status {status!r}"
                status = "failed"
            self._enqueue("status", {"state": status, "message": _text(message)}, 200, force=True)
            return self._drain()
        except Exception as exc:
            self._fault("finish", exc)
            return False

    def close(self) -> bool:
        """Drain what was logged without ending the run: a later ``init(resume=<dir>)`` goes on
        with it (``follow`` after a problem it cannot go on with). Returns whether everything
        was shipped. After ``finish`` or ``close``, nothing more is taken."""
        if self._finished:
            return False
        self._finished = True
        try:
            return self._drain()
        except Exception as exc:
            self._fault("close", exc)
            return False

    @property
    def skipped_values(self) -> int:
        """Values the protocol cannot carry, skipped (a metric that is no number, a bad name, a
        call with a bad step, a sample that is no dict...)."""
        return self._skipped + self._writer_skipped

    @property
    def acked_seq(self) -> int:
        """The last seq the web app acknowledged as stored (0 before it said anything)."""
        shipper = self._shipper
        return shipper.acked_seq if shipper is not None else 0

    @property
    def shipper(self) -> EventShipper | None:
        """The shipper of the current connection to the web app (None offline or before the
        server run exists): its ``connections``, ``backoff_delays`` and ``error`` tell how it goes."""
        return self._shipper

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is None:
            self.finish("cancelled" if self.should_stop() else "succeeded")
        elif issubclass(kind, KeyboardInterrupt):
            self.finish("cancelled", "interrupted (KeyboardInterrupt)")
        else:
            self.finish("failed", f"{kind.__name__}: {exc}")

    def __repr__(self) -> str:
        return f"<tributary.Run {self.meta.get('name')!r} dir={str(self.dir)!r} id={self.id}>"

    # ------------------------------------------------------------------ checks and the queue

    def _metric_values(self, values: dict[Any, Any]) -> dict[str, float | None]:
        """On the writer thread: the metrics the protocol carries (names of 1-200 characters of
        text, finite numbers; NaN and inf as null), the others skipped and counted."""
        out: dict[str, float | None] = {}
        skipped = 0
        pairs: Any = values.items()
        if len(values) > MAX_METRICS_PER_CALL:
            skipped = len(values) - MAX_METRICS_PER_CALL
            pairs = itertools.islice(pairs, MAX_METRICS_PER_CALL)
            self._warn(
                "many-metrics",
                f"a log() call has more than {MAX_METRICS_PER_CALL} metrics; the rest are skipped",
            )
        for name, value in pairs:
            if type(name) is not str or not 0 < len(name) <= MAX_NAME or value is _NOT_A_NUMBER:
                skipped += 1
                continue
            if type(value) is not float:
                try:
                    value = float(value)
                except OverflowError:  # an integer beyond any float
                    value = math.inf
            out[name] = value if value - value == 0.0 else None  # inf - inf and NaN - NaN are NaN
        if skipped:
            self._writer_skipped += skipped
            self._warn(
                "bad-metric",
                "some metrics were skipped: a name must be 1-200 characters of text, a value a number",
            )
        return out

    def _take_step(self, step: Any, *, advance: bool) -> int | None:
        if step is None:
            if not advance:
                return max(self._step, 0)
            at = self._step + 1
        else:
            try:
                at = operator.index(step)
            except TypeError:
                at = -1
            if not 0 <= at <= MAX_STEP:
                self._skipped += 1
                self._warn(
                    "bad-step", f"a call with step={step!r} was skipped: a step is an integer in [0, 2^31)"
                )
                return None
        self._step = at
        return at

    def _sample(self, item: Any) -> dict[str, Any] | None:
        if not isinstance(item, Mapping):
            self._skipped += 1
            self._warn("bad-sample", "a sample that is not a dict was skipped")
            return None
        extra_in = item.get("extra")
        extra = (
            dict(extra_in)
            if isinstance(extra_in, Mapping)
            else ({} if extra_in is None else {"extra": extra_in})
        )
        for key, value in item.items():
            if key not in SAMPLE_KEYS:
                extra[str(key)] = value
        try:
            length = operator.index(item.get("length") or 0)
        except TypeError:
            length = -1
        if not 0 <= length <= MAX_STEP:
            self._skipped += 1
            length = 0
        return {
            "prompt": _text(item.get("prompt", "")),
            "completion": _text(item.get("completion", "")),
            "reward": self._optional_number(item.get("reward")),
            "advantage": self._optional_number(item.get("advantage")),
            "length": length,
            "finish_reason": _text(item.get("finish_reason") or "")[:MAX_FINISH_REASON],
            "extra": clean(extra, EXTRA_DEPTH) if extra else {},
        }

    def _optional_number(self, value: Any) -> float | None:
        if value is None:
            return None
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            self._skipped += 1
            return None
        return number if math.isfinite(number) else None

    def _enqueue(self, kind: str, fields: dict[str, Any], weight: int, *, force: bool = False) -> bool:
        with self._cond:
            if self._closed:
                self._warn("closed", f"a {kind} event after finish() was dropped")
                self.dropped_events += 1
                return False
            if not force and (
                len(self._queue) >= self.max_queue_events
                or self._queued_bytes + weight > self.max_queue_bytes
            ):
                self.dropped_events += 1
                self._warn(
                    "dropped",
                    "the event queue is full (the writer thread is behind: a slow or stalled disk?); "
                    "events are dropped and counted in Run.dropped_events",
                )
                return False
            self._seq += 1
            self._queue.append((self._seq, kind, fields))
            self._queued_bytes += weight
            self._cond.notify()
            return True

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        fh = None
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._closed:
                        self._cond.wait()
                    batch = list(self._queue)
                    self._queue.clear()
                    self._queued_bytes = 0
                    if not batch:
                        return  # closed and empty
                text = "".join(self._line(*event) for event in batch)
                while True:  # until the batch is on disk: seqs must stay consecutive in the file
                    try:
                        if fh is None:
                            fh = _open_log(self.events_path)
                        fh.write(text)
                        fh.flush()
                        break
                    except OSError as exc:
                        self._fault("write", exc)
                        with contextlib.suppress(OSError):
                            if fh is not None:
                                fh.close()
                        fh = None
                        time.sleep(1.0)
                if any(kind == "status" for _, kind, _ in batch):
                    try:  # a final status must survive a crash of the machine
                        os.fsync(fh.fileno())
                    except OSError as exc:  # not a disk file (a pipe), or the disk failed: said once
                        self._fault("fsync", exc)
                with self._cond:
                    self.written_seq = batch[-1][0]
                    self._written.notify_all()
                shipper = self._shipper
                if shipper is not None:
                    shipper.wake()  # ships the batch now, not at the shipper's next poll
        except Exception as exc:
            self._fault("writer", exc)
        finally:
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()

    def _line(self, seq: int, kind: str, fields: dict[str, Any]) -> str:
        try:
            if kind == "metrics":
                # Checked here: names are text, numbers finite floats or None, so of ``clean``
                # (``encode``) only the names' storable text is left to do: the hot path's JSON.
                values = self._metric_values(fields["values"])
                joined = "".join(values)
                if clean_text(joined) is not joined:  # the same object back: nothing to replace
                    values = {clean_text(name): value for name, value in values.items()}
                return (
                    dumps({"run": self.client_id, "seq": seq, "type": kind, **fields, "values": values})
                    + "\n"
                )
            return encode({"run": self.client_id, "seq": seq, "type": kind, **fields}) + "\n"
        except Exception as exc:  # keep the seq in the chain, say why its event is missing
            self._fault("encode", exc)
            message = f"event {seq} ({kind}) could not be encoded: {exc!r}"[:2000]
            return (
                encode(
                    {"run": self.client_id, "seq": seq, "type": "log", "level": "error", "message": message}
                )
                + "\n"
            )

    # ------------------------------------------------------------------ the link thread

    def _link_main(self) -> None:
        assert self._api is not None
        attempt = 0
        server: ServerRun | None = None
        contact, self._contact = self._contact, None
        try:
            while not self._past_deadline():
                if server is None:
                    try:
                        if isinstance(contact, ApiError):
                            raise contact
                        server = contact or self._server_run()
                    except ApiError as exc:
                        if exc.held_by is not None:
                            self._refuse(self._refusal(exc))
                            return
                        if not exc.retriable:
                            self._stop_link(f"the web app refused the run: {exc}")
                            return
                        self._warn(
                            "api-down",
                            f"cannot reach the web app yet ({exc}); retrying, events wait in {self.events_path}",
                        )
                        self._pause(attempt)
                        attempt += 1
                        continue
                    finally:
                        contact = None
                shipper = EventShipper(
                    self._web_url or "",
                    server.id,
                    server.ingest_token,
                    self.events_path,
                    on_hello=self._on_hello,
                    on_cancel=self._on_cancel,
                    claim=self.claim,  # attach holds the run (a web app that checks it refuses another's)
                    # woken: the writer thread calls shipper.wake() after each write
                    **{**SHIPPER_DEFAULTS, "woken": True, **self._shipper_options},
                )
                self._shipper = shipper
                shipper.start()
                while not shipper.done.is_set():
                    if self._finishing.wait(1.0):  # finish() wakes this at once
                        shipper.finish(self._time_left())
                        break
                shipper.join()
                if shipper.claim_lost:  # at attach, or later (4409): another script holds the run
                    self._refuse(RunRefused(shipper.claim_lost, server.id, ""))
                    return
                if shipper.drained or shipper.gave_up or self._past_deadline():
                    return
                if shipper.error is not None and shipper.error.code == CLOSE_RUN_OVER:
                    self._stop_requested.set()  # the web app ended the run: nothing more is taken
                if shipper.error is not None and shipper.error.code == CLOSE_BAD_TOKEN:
                    # Expired while the server was out of reach: ask for a fresh one. A fresh one
                    # refused too (no hello at all) backs off as an unreachable API does.
                    server = None
                    attempt = 0 if shipper.connections else attempt + 1
                    if attempt:
                        self._pause(attempt)
                    continue
                self._stop_link(str(shipper.error or "the shipper stopped"))
                return
        except Exception as exc:
            self._fault("link", exc)
            self.link_error = self.link_error or repr(exc)

    def _pause(self, attempt: int) -> None:
        delay = min(backoff_delay(attempt, base=0.5, cap=30.0), self._time_left())
        if self._finishing.is_set():
            time.sleep(delay)
        else:
            self._finishing.wait(delay)  # finish() cuts the wait short: one more try, then drain

    def _server_run(self, api: Api | None = None) -> ServerRun:
        api = api or self._api
        assert api is not None
        server = server_run(api, self.dir, self.meta, self._meta_lock, claim=self.claim)
        self.id, self.url = server.id, server.url
        return server

    def _refusal(self, exc: ApiError) -> RunRefused:
        return RunRefused(str(exc), self.meta.get("server_id"), exc.held_by or "")

    def _refuse(self, refused: RunRefused) -> None:
        """Another script holds the run: say so now (stderr), stop training (``should_stop``),
        and raise it from the next logging call."""
        self.refused = refused
        self.link_error = str(refused)
        self._stop_requested.set()
        _say(f"tributary: the web app refused this script its run: {refused}")

    def _on_hello(self, hello: Hello, first: bool) -> bool:
        # A Cancel while the script was away, or a run the web app already ended (cancelled
        # while it waited for its script): either way, training should stop.
        if hello.cancel or hello.status in FINAL_STATES:
            self._stop_requested.set()
        return True

    def _on_cancel(self, message: str) -> None:
        self._stop_requested.set()

    def _stop_link(self, why: str) -> None:
        self.link_error = why
        self._warn("link", f"stopped sending run {self.meta['name']} to the web app: {why}")

    def _time_left(self) -> float:
        return math.inf if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    # ------------------------------------------------------------------ the end

    def _drain(self) -> bool:
        self._deadline = time.monotonic() + self.drain_s
        with self._cond:
            self._closed = True
            self._cond.notify()
        # Writing the local log is not the network's to time out: a disk gets its own grace.
        self._writer.join(max(self._time_left(), WRITER_GRACE_S))
        self._finishing.set()
        if self._link is not None:
            self._link.join(self._time_left() + 15.0)  # the shipper's own close and join take a few seconds
        shipper = self._shipper
        acked = shipper.acked_seq if shipper is not None else 0
        sent_all = self._link is not None and shipper is not None and shipper.drained
        _unregister_exit(self._at_exit)
        where = shlex.quote(str(self.dir))
        if self._link is None:
            _say(
                f"tributary: run {self.meta['name']!r} was written offline to {self.dir} ({self.written_seq} events); "
                f"send it with: TRIBUTARY_URL=... TRIBUTARY_TOKEN=... python -m tributary sync {where}"
            )
        elif (
            self.refused is not None
        ):  # said when it came; sync would be refused too while the other holds it
            _say(
                f"tributary: the web app takes no events of run {self.meta['name']!r} from this script (another "
                f"script holds the run); they stay in {self.events_path}"
            )
        elif shipper is not None and shipper.error is not None and shipper.error.code in FATAL_CLOSE_CODES:
            _say(
                f"tributary: the web app will take no more events of run {self.meta['name']!r} ({shipper.error}); "
                f"{max(0, self._seq - acked)} of {self._seq} were not stored. They stay in {self.events_path}"
            )
        elif not sent_all:
            if shipper is not None and shipper.error is not None:
                why = str(shipper.error)
            elif self.link_error:
                why = self.link_error
            elif shipper is None:
                why = "the web app was not reachable"
            else:
                why = f"the drain timeout of {self.drain_s:g} s ({DRAIN_ENV}) passed"
            _say(
                f"tributary: {max(0, self._seq - acked)} of {self._seq} events of run {self.meta['name']!r} were "
                f"not sent ({why}); they are in {self.events_path}. Send them with: python -m tributary sync {where}"
            )
        elif self.url:
            _say(f"tributary: run {self.meta['name']!r} is at {self.url}")
        if self.written_seq < self._seq:
            _say(
                f"tributary: {self._seq - self.written_seq} events could not be written to {self.events_path} in time"
            )
        elif not self._writer.is_alive():
            self._dir_lock.close()  # the directory is free for a resume or a sync
        return sent_all

    def _at_exit(self) -> None:
        if self._finished:
            return
        failure = getattr(sys, "last_value", None)
        if failure is not None:
            self.finish("failed", f"{type(failure).__name__}: {failure}")
        else:
            self.finish(
                "cancelled" if self.should_stop() else "succeeded", "the script exited without finish()"
            )

    # ------------------------------------------------------------------ errors, once

    def _fault(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._warn(f"fault-{where}", f"{where} failed ({exc!r}); training goes on", exc_info=exc)

    def _warn(self, key: str, message: str, exc_info: BaseException | None = None) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("tributary: %s", message, exc_info=exc_info)

    def _save_meta(self) -> None:
        write_meta(self.dir, self.meta)


# ---------------------------------------------------------------------- helpers


def dir_claim(directory: Path, meta: dict[str, Any]) -> str:
    """The claim of a script writing ``directory`` on this host (``tributary.protocol.script_claim``):
    its ``run.json``'s lineage (a directory of before claims: its ``client_id``), and the place."""
    lineage = meta.get("claim")
    if not isinstance(lineage, str) or not re.fullmatch(r"[0-9A-Za-z_-]{1,51}", lineage):
        lineage = str(meta["client_id"]).replace("-", "")
    return script_claim(lineage, socket.gethostname(), os.path.realpath(directory))


def server_run(
    api: Api, directory: Path, meta: dict[str, Any], lock: threading.Lock | None = None, *, claim: str = ""
) -> ServerRun:
    """The server run of the run in ``directory`` with a fresh ingest token: created through the
    API the first time (idempotent: ``client_id``), its id then kept in ``run.json``. With a
    ``claim``, only while no other script holds it (``ApiError.held_by`` else)."""
    script = {"claim": claim, "host": socket.gethostname()[:255], "pid": os.getpid()} if claim else None
    if meta.get("server_id") is not None and meta.get("url") in (None, api.url):
        return api.ingest_token(int(meta["server_id"]), str(meta.get("server_url") or ""), script)
    # Never created, or created on another web app (its id means nothing here): create it here,
    # the same client_id making a retry or a later sync find it again.
    server = api.create_run(
        project=meta["project"],
        name=meta["name"],
        config=meta.get("config") or {},
        tags=meta.get("tags") or [],
        client_id=meta["client_id"],
        script=script,
    )
    with lock or contextlib.nullcontext():
        meta.update(server_id=server.id, server_url=server.url, url=api.url)
        write_meta(directory, meta)
    log.info("tributary: run %s is at %s", meta["name"], server.url)
    return server


def read_meta(directory: Path) -> dict[str, Any]:
    """A run directory's ``run.json``; a ``ValueError`` that names the directory when unusable."""
    path = Path(directory) / RUN_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{directory} is not a Tributary run directory: it has no {RUN_FILE}") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("client_id"), str) or not meta.get("project"):
        raise ValueError(f"{path} is not a Tributary run file (no project or client_id)")
    return meta


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Replace ``run.json`` whole (a crash leaves the old file or the new one, never half)."""
    target = Path(directory) / RUN_FILE
    temporary = target.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(meta, ensure_ascii=False, indent=1, allow_nan=False), encoding="utf-8")
    os.replace(temporary, target)


def _open_log(path: Path) -> Any:
    repair_torn_tail(path)
    return path.open("a", encoding="utf-8")


def _lock_run_dir(directory: Path) -> Any:
    """An exclusive lock on the run directory (``run.lock``), held while this process writes its
    log: a second writer (a script still running while a resume starts, two ``follow``) would
    take the same seqs, and the web app keeps only the first event of each."""
    handle = (Path(directory) / LOCK_FILE).open("a")
    if fcntl is not None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ValueError(
                f"{directory} is being written by another process (a script or follow still running): "
                "stop it first, or use another directory"
            ) from None
    return handle


def _meta_url(directory: Path) -> str | None:
    with contextlib.suppress(ValueError):
        return read_meta(directory).get("url") or None
    return None


_PLAIN_NUMBERS = frozenset({float, int})
_NOT_A_NUMBER = object()  # a metric whose value float() refused, skipped on the writer thread


def _as_float(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return _NOT_A_NUMBER


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - len(CUT_MARK)] + CUT_MARK


def _sample_bytes(sample: dict[str, Any]) -> int:
    extra = sample["extra"]
    return len(sample["prompt"]) + len(sample["completion"]) + (len(json.dumps(extra)) if extra else 0) + 160


def _name(name: Any, local_id: str) -> str:
    if name is None or name == "":
        script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"
        return f"{script or 'python'}-{local_id}"[:200]
    if not isinstance(name, str):
        raise ValueError(f"name must be text, got {type(name).__name__}")
    return name.strip()[:200]


def _config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        # argparse.Namespace and dataclass-like objects: their attributes.
        if hasattr(config, "__dict__"):
            config = vars(config)
        else:
            raise ValueError(
                f"config must be a dict (or an object with attributes), got {type(config).__name__}"
            )
    cleaned = clean(dict(config), 2)  # one level below the API's body: MAX_DEPTH levels in all
    size = len(json.dumps(cleaned, ensure_ascii=False).encode())
    if size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"config is {size} bytes as JSON; the limit is {MAX_CONFIG_BYTES}: keep settings there, not data"
        )
    return cleaned


def _tags(tags: list[str] | tuple[str, ...] | None) -> list[str]:
    if tags is None:
        return []
    if isinstance(tags, str) or not isinstance(tags, list | tuple):
        raise ValueError(f"tags must be a list of text, got {tags!r:.100}")
    out: list[str] = []
    for tag in tags:
        text = str(tag).strip()
        if not 0 < len(text) <= MAX_TAG:
            raise ValueError(f"tags: each tag must be 1-{MAX_TAG} characters, got {text!r:.80}")
        if text not in out:
            out.append(text)
    if len(out) > MAX_TAGS:
        raise ValueError(f"tags: {len(out)} tags; the limit is {MAX_TAGS}")
    return out


def _drain_seconds(drain_s: float | None) -> float:
    if drain_s is not None:
        value: Any = drain_s
        source = "drain_s"
    else:
        value = os.environ.get(DRAIN_ENV, DEFAULT_DRAIN_S)
        source = DRAIN_ENV
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}={value!r} is not a number of seconds") from None
    if not 0 <= seconds <= 24 * 3600:
        raise ValueError(f"{source}={value!r}: give a number of seconds in [0, 86400]")
    return seconds


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)


# The interpreter's exit finishes unfinished runs. threading's own exit hook runs while threads
# may still be started (websockets' sync client starts one per connection; Python 3.12 refuses
# new threads once ``atexit`` hooks run), and after an uncaught exception set sys.last_value.
_register = getattr(threading, "_register_atexit", None)


def _register_exit(hook: Any) -> None:
    if _register is not None:
        _EXIT_HOOKS.append(hook)
    else:
        atexit.register(hook)


def _unregister_exit(hook: Any) -> None:
    if _register is not None:
        with contextlib.suppress(ValueError):
            _EXIT_HOOKS.remove(hook)
    else:
        atexit.unregister(hook)


_EXIT_HOOKS: list[Any] = []


def _run_exit_hooks() -> None:
    for hook in list(_EXIT_HOOKS):
        with contextlib.suppress(Exception):
            hook()


if _register is not None:
    _register(_run_exit_hooks)
