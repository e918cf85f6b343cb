"""The run supervisor: one engine run on a worker, from the ingest socket's ``hello`` to the last ack.

``RunSupervisor.run()``:

1. Makes the run's working directory (``$TRIBUTARY_RUNS_DIR/<run>``, default
   ``<data dir>/runs/<run>``) and writes ``config.json`` there with ``output_dir`` pointing at it.
2. Connects to the web app's ingest socket (``EventShipper``) and reads ``hello`` before
   anything else: a run already final (cancelled while queued) is not started; a run with a
   cancel pending is not started either, but gets a ``cancelled`` status event so the web app
   learns it through the usual path. Otherwise it sends ``attach`` and starts
   ``python -m engine run config.json --events events.jsonl ...`` in its own process group,
   stdout and stderr to ``engine.log``.
3. Ships events while the engine runs. A ``cancel`` (or a later ``hello`` saying the run is
   final or a cancel is pending, a fatal refusal of the socket, or the worker shutting down:
   ``cancel_all``) sends SIGTERM to the engine's process group (the engine checkpoints and
   exits 3), then SIGKILL after ``CANCEL_GRACE`` seconds. Should the supervisor's process die,
   the engine gets one SIGTERM through its launcher (``ENGINE_LAUNCHER``) and checkpoints.
4. After the engine exits, if its log has no final status event (a crash, SIGKILL, exit 2 for a
   bad config), appends with ``EventSink`` a ``log`` event with the tail of ``engine.log`` and a
   ``status`` event: ``cancelled`` if it was killed after a cancel request, else ``failed``.
5. Drains: ships until everything is acked, giving up after ``SHIP_DRAIN_TIMEOUT`` seconds
   (the log stays on disk).

Environment: ``TRIBUTARY_WEB_URL`` (the web app's base URL, default ``http://127.0.0.1:8000``),
``TRIBUTARY_RUNS_DIR``, ``CANCEL_GRACE`` (s, default 30), ``SHIP_DRAIN_TIMEOUT`` (s, default
300), ``TRIBUTARY_CONNECT_TIMEOUT`` (s to reach the web app before giving a run up, default 300).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.events import EventSink
from engine.paths import DATA_DIR_ENV, data_dir
from jobs.shipper import EventShipper, Hello

log = logging.getLogger(__name__)

WEB_URL_ENV = "TRIBUTARY_WEB_URL"
RUNS_DIR_ENV = "TRIBUTARY_RUNS_DIR"
CANCEL_GRACE_ENV = "CANCEL_GRACE"
DRAIN_TIMEOUT_ENV = "SHIP_DRAIN_TIMEOUT"
CONNECT_TIMEOUT_ENV = "TRIBUTARY_CONNECT_TIMEOUT"
DEFAULT_WEB_URL = "http://127.0.0.1:8000"

FINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "lost"})
ENGINE_FINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
EXIT_STATES = {0: "succeeded", 1: "failed", 2: "failed", 3: "cancelled"}
STDERR_TAIL_LINES = 40

# The engine runs under a small single-threaded launcher (``python -c ENGINE_LAUNCHER``):
# should the supervisor's process die (even by SIGKILL), the kernel tells the launcher
# (PR_SET_PDEATHSIG, SIGUSR1), which sends the engine one SIGTERM (it checkpoints and stops
# instead of training on unsupervised), then SIGKILL after the grace period. Not PDEATHSIG
# on the engine itself: the worker is multi-threaded, and the kernel sends the signal again
# each time the child passes to another dying thread; a second SIGTERM makes the engine stop
# without its checkpoint. The launcher ignores the process group's SIGTERM/SIGINT (a Python
# handler, reset to the default in the engine by exec) and exits as the engine did.
ENGINE_LAUNCHER = r"""
import ctypes, os, signal, subprocess, sys
parent, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
child, orphaned = None, []
def parent_gone(signum, frame):
    if not orphaned:
        orphaned.append(True)
        if child is not None:
            stop()
def stop():
    os.kill(child.pid, signal.SIGTERM)
    signal.setitimer(signal.ITIMER_REAL, max(grace, 0.01))
signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGINT, lambda *_: None)
signal.signal(signal.SIGUSR1, parent_gone)
signal.signal(signal.SIGALRM, lambda *_: os.kill(child.pid, signal.SIGKILL))
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR1))  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit("the run supervisor exited before the engine started")
child = subprocess.Popen(argv)
if orphaned:
    stop()
code = child.wait()
if code < 0:
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), -code)
sys.exit(code)
"""

CONFIG_FILE = "config.json"
EVENTS_FILE = "events.jsonl"
ENGINE_LOG_FILE = "engine.log"


# Stop requests for every run of this process (the worker is shutting down). Appending to a
# list is all a signal handler may safely do here; the supervisors poll it twice a second.
_stop_all_requests: list[str] = []


def cancel_all(message: str) -> None:
    """Ask every run this process supervises to stop the clean way (signal-safe)."""
    _stop_all_requests.append(message)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds (e.g. {name}={default:g})") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must be >= 0 seconds")
    return value


def runs_dir() -> Path:
    """Where runs' working directories live: ``$TRIBUTARY_RUNS_DIR`` or ``<data dir>/runs``."""
    value = os.environ.get(RUNS_DIR_ENV, "").strip()
    return Path(value).expanduser() if value else data_dir() / "runs"


def default_web_url() -> str:
    """The web app's base URL: ``$TRIBUTARY_WEB_URL`` or ``http://127.0.0.1:8000``."""
    return os.environ.get(WEB_URL_ENV, "").strip() or DEFAULT_WEB_URL


@dataclass
class RunResult:
    """What a supervised run came to (the Celery task's return value, as a dict)."""

    run_id: int | str
    started: bool
    state: str  # the run's final state as the worker saw it, or the web app's status when not started
    exit_code: int | None = None
    acked_seq: int = 0
    drained: bool = False
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def last_status(path: Path, *, after: int = 0, tail_bytes: int = 1 << 20) -> dict[str, Any] | None:
    """The last ``status`` event of a JSONL log written after byte ``after`` (looked for in the
    file's tail first), or None."""
    if not path.exists():
        return None
    size = path.stat().st_size
    with path.open("rb") as fh:
        for start in (max(after, size - tail_bytes), after):
            fh.seek(start)
            found = None
            for raw in fh:
                if b'"status"' not in raw:
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("type") == "status":
                    found = event
            if found is not None or start == after:
                return found
    return None


def output_tail(path: Path, lines: int = STDERR_TAIL_LINES, *, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a process's output (progress-bar redraws reduced to their last state)."""
    if not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(max(0, path.stat().st_size - max_bytes))
        text = fh.read().decode("utf-8", errors="replace")
    kept = [line.rsplit("\r", 1)[-1].rstrip() for line in text.rstrip("\r\n").split("\n")]
    return "\n".join([line for line in kept if line][-lines:])


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine was killed by {name}"
    meaning = {1: "failed", 2: "bad config", 3: "cancelled"}.get(code, "unknown exit code")
    return f"the engine exited with code {code} ({meaning})"


class RunSupervisor:
    """Supervises one engine run and ships its events; see the module docstring."""

    def __init__(
        self,
        run_id: int | str,
        config: dict[str, Any],
        token: str,
        *,
        start_seq: int = 0,
        resume_path: str | None = None,
        web_url: str | None = None,
        workdir: str | Path | None = None,
        cancel_grace: float | None = None,
        drain_timeout: float | None = None,
        connect_timeout: float | None = None,
        python: str = sys.executable,
        shipper_options: dict[str, Any] | None = None,
        gpus: list[int] | None = None,
    ) -> None:
        self.run_id = run_id
        self.config = dict(config)
        self.token = token
        self.start_seq = int(start_seq or 0)
        self.resume_path = resume_path
        self.web_url = web_url or default_web_url()
        self.workdir = Path(workdir) if workdir is not None else runs_dir() / str(run_id)
        self.cancel_grace = _env_float(CANCEL_GRACE_ENV, 30.0) if cancel_grace is None else cancel_grace
        self.drain_timeout = _env_float(DRAIN_TIMEOUT_ENV, 300.0) if drain_timeout is None else drain_timeout
        self.connect_timeout = (
            _env_float(CONNECT_TIMEOUT_ENV, 300.0) if connect_timeout is None else connect_timeout
        )
        self.python = python
        self.shipper_options = shipper_options or {}
        self.gpus = gpus  # the CUDA devices lent to this run (None: the worker has none to lend)

        self.events_path = self.workdir / EVENTS_FILE
        self.engine_log_path = self.workdir / ENGINE_LOG_FILE
        self.proc: subprocess.Popen[bytes] | None = None
        self.shipper: EventShipper | None = None

        self._wake = threading.Event()
        self._decided = threading.Event()
        self._decision = ""  # "start", "skip" (final) or "cancelled" (cancel pending before start)
        self._first_hello: Hello | None = None
        self._cancel = threading.Event()
        self._cancel_message = ""
        self._term_at: float | None = None
        self._killed = False
        self._log_start = 0

    # -- called from the shipper thread -------------------------------------------------------

    def _on_hello(self, hello: Hello, first: bool) -> bool:
        if first:
            self._first_hello = hello
            if hello.status in FINAL_STATES:
                self._decision = "skip"
            elif hello.cancel:
                self._decision = "cancelled"
            else:
                self._decision = "start"
            self._decided.set()
            self._wake.set()
            return self._decision != "skip"
        if hello.cancel or hello.status in FINAL_STATES:
            self.cancel(f"the web app says the run is {hello.status or 'to be cancelled'}")
        return True

    def cancel(self, message: str = "cancelled") -> None:
        """Ask the engine to stop (thread-safe): SIGTERM now, SIGKILL after the grace period."""
        if not self._cancel.is_set():
            self._cancel_message = message
            self._cancel.set()
        self._wake.set()

    # -- the run ------------------------------------------------------------------------------

    def _prepare(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        # output_dir may use {name}; escape braces so the working directory is taken literally.
        config["output_dir"] = str(self.workdir).replace("{", "{{").replace("}", "}}")
        path = self.workdir / CONFIG_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        tmp.replace(path)
        return path

    def _make_shipper(self) -> EventShipper:
        return EventShipper(
            self.web_url,
            self.run_id,
            self.token,
            self.events_path,
            on_hello=self._on_hello,
            on_cancel=self.cancel,
            **self.shipper_options,
        )

    def _seq_floor(self) -> int:
        hello_seq = self._first_hello.last_seq if self._first_hello is not None else 0
        return max(self.start_seq, hello_seq)

    def _poll_stop_all(self) -> None:
        if _stop_all_requests and not self._cancel.is_set():
            self.cancel(_stop_all_requests[-1])

    def run(self) -> RunResult:
        """Supervise the run to its end (see the module docstring)."""
        config_path = self._prepare()
        shipper = self.shipper = self._make_shipper().start()
        log.info("run %s: connecting to %s", self.run_id, self.web_url)
        deadline = time.monotonic() + self.connect_timeout
        while not self._decided.is_set() and not shipper.done.is_set() and not self._cancel.is_set():
            if time.monotonic() >= deadline:
                break
            self._wake.wait(0.5)
            self._wake.clear()
            self._poll_stop_all()
        if not self._decided.is_set():
            shipper.stop()
            if shipper.error:
                error = str(shipper.error)
            elif self._cancel.is_set():
                error = f"cancelled before the web app answered: {self._cancel_message}"
            else:
                error = f"could not reach the web app at {self.web_url} within {self.connect_timeout:g} s"
            log.error("run %s: not started: %s", self.run_id, error)
            return RunResult(self.run_id, started=False, state="not started", error=error)

        hello = self._first_hello
        assert hello is not None
        if self._decision == "skip":
            shipper.join(30)
            log.info("run %s: not started: the run is already %s", self.run_id, hello.status)
            return RunResult(self.run_id, started=False, state=hello.status, acked_seq=shipper.acked_seq)
        if self._decision == "cancelled" or self._cancel.is_set():
            reason = "a cancel was pending" if self._decision == "cancelled" else self._cancel_message
            sink = EventSink(str(self.run_id), self.events_path, start_seq=self._seq_floor())
            sink.status("cancelled", f"cancelled before the engine started ({reason})")
            sink.close()
            drained = shipper.finish(self.drain_timeout)
            return RunResult(
                self.run_id,
                started=False,
                state="cancelled",
                acked_seq=shipper.acked_seq,
                drained=drained,
                error=str(shipper.error or ""),
            )

        code = self._run_engine(config_path, shipper)
        state = self._conclude(code)
        drained = shipper.finish(self.drain_timeout) if shipper.error is None else False
        result = RunResult(
            self.run_id,
            started=True,
            state=state,
            exit_code=code,
            acked_seq=shipper.acked_seq,
            drained=drained,
            error=str(shipper.error or ""),
        )
        log.info(
            "run %s: %s (exit code %s), events acked up to seq %d", self.run_id, state, code, result.acked_seq
        )
        return result

    def engine_command(self, config_path: Path) -> list[str]:
        cmd = [
            self.python, "-c", ENGINE_LAUNCHER, str(os.getpid()), str(self.cancel_grace),
            self.python, "-m", "engine", "run", str(config_path),
            "--events", str(self.events_path),
            "--run-id", str(self.run_id),
            "--start-seq", str(self._seq_floor()),
            "--progress", "off",
        ]  # fmt: skip
        if self.resume_path:
            cmd += ["--resume", str(self.resume_path)]
        return cmd

    def _run_engine(self, config_path: Path, shipper: EventShipper) -> int:
        env = dict(os.environ)
        env[DATA_DIR_ENV] = str(data_dir())
        env["PYTHONUNBUFFERED"] = "1"
        if self.gpus is not None:  # only its own GPUs ("" keeps a CPU run off them)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        # Only what this engine writes counts when looking for its final status (a task
        # delivered again to this machine appends to the same log).
        self._log_start = self.events_path.stat().st_size if self.events_path.exists() else 0
        with self.engine_log_path.open("ab") as out:
            self.proc = proc = subprocess.Popen(
                self.engine_command(config_path),
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach its helpers too
            )
        log.info("run %s: engine started (process group %d) in %s", self.run_id, proc.pid, self.workdir)
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if shipper.error is not None and not self._cancel.is_set():
                self.cancel(f"the web app refused the run's events: {shipper.error}")
            self._poll_stop_all()
            if self._cancel.is_set():
                self._escalate(proc)
            self._wake.wait(0.3)
            self._wake.clear()
        _signal_group(proc.pid, signal.SIGKILL)  # helpers the engine left behind, if any
        return code

    def _escalate(self, proc: subprocess.Popen[bytes]) -> None:
        now = time.monotonic()
        if self._term_at is None:
            self._term_at = now
            log.info("run %s: cancel (%s): SIGTERM to the engine", self.run_id, self._cancel_message)
            _signal_group(proc.pid, signal.SIGTERM)
        elif not self._killed and now - self._term_at >= self.cancel_grace:
            self._killed = True
            log.warning(
                "run %s: the engine did not stop within %g s of SIGTERM: SIGKILL",
                self.run_id,
                self.cancel_grace,
            )
            _signal_group(proc.pid, signal.SIGKILL)

    def _conclude(self, code: int) -> str:
        """The run's final state; appends the events the engine could not write itself."""
        final = last_status(self.events_path, after=self._log_start)
        if final is not None and final.get("state") in ENGINE_FINAL_STATES:
            return str(final["state"])
        cancelled = self._cancel.is_set() and (code < 0 or code == 3)
        state = "cancelled" if cancelled else EXIT_STATES.get(code, "failed")
        if state == "succeeded":  # exit 0 without saying so: do not claim success
            state = "failed"
        what = describe_exit(code)
        if state == "cancelled":
            message = f"cancelled ({self._cancel_message}); {what}"
        else:
            message = f"{what} without reporting a final status; see its output in the log"
        tail = output_tail(self.engine_log_path)
        sink = EventSink(str(self.run_id), self.events_path, start_seq=self._seq_floor())
        try:
            if tail:
                sink.log("warning" if state == "cancelled" else "error", f"{what}; its last output:\n{tail}")
            sink.status(state, message)  # type: ignore[arg-type]
        finally:
            sink.close()
        log.warning("run %s: %s", self.run_id, message)
        return state


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
