"""The run supervisor: one engine run on a worker, from the ingest socket's ``hello`` to the last ack.

``RunSupervisor.run()``:

1. Once the run is its own (step 2), makes the run's working directory (``$TRIBUTARY_RUNS_DIR/<run>``,
   default ``<data dir>/runs/<run>``) and writes ``config.json`` there with ``output_dir`` pointing at it.
2. Connects to the web app's ingest socket (``EventShipper``) and reads ``hello`` before
   anything else: a run already final (cancelled while queued) is not started; a run with a
   cancel pending is not started either, but gets a ``cancelled`` status event so the web app
   learns it through the usual path. Otherwise it sends ``attach`` with its claim id and, once
   the web app answers that the claim won (one supervisor per run wins; the holder of a
   duplicate of the queue message ends there, writing nothing), starts
   ``python -m engine run config.json --events events.jsonl ...`` in its own process group,
   stdout and stderr to ``engine.log``, under ``jobs/launcher.py`` and confined
   (``jobs/confine.py``: a scrubbed environment, Landlock, no capabilities); a log event says
   how it is confined, or why it is not. What the engine writes to ``engine.log`` from then on
   is shipped too (``OutputLog``), for the run page's Logs tab and its full-log download.
3. Ships events while the engine runs. A ``cancel`` (or a later ``hello`` saying the run is
   final or a cancel is pending, a fatal refusal of the socket, or the worker shutting down:
   ``cancel_all``) sends SIGTERM to the engine's process group (the engine checkpoints and
   exits 3), then SIGKILL after ``CANCEL_GRACE`` seconds. Should the supervisor's process die,
   the engine gets one SIGTERM through its launcher (``jobs/launcher.py``) and checkpoints.
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
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.contracts import (
    ENGINE_FINAL_STATES,
    EXIT_CANCELLED,
    EXIT_NAMES,
    EXIT_STATES,
    EXIT_SUCCEEDED,
    FINAL_STATES,
)
from engine.paths import DATA_DIR_ENV, data_dir
from engine.rewards.policy import RewardPolicy
from jobs.confine import ConfinementPlan, confine_mode, engine_environment, landlock_abi
from tributary.events import EventSink, last_seq_in
from tributary.protocol import ATTACH_ENGINE_FROM, HELLO_CLAIMS
from tributary.shipper import EventShipper, Hello, OutputLog

log = logging.getLogger(__name__)

WEB_URL_ENV = "TRIBUTARY_WEB_URL"
RUNS_DIR_ENV = "TRIBUTARY_RUNS_DIR"
CANCEL_GRACE_ENV = "CANCEL_GRACE"
DRAIN_TIMEOUT_ENV = "SHIP_DRAIN_TIMEOUT"
CONNECT_TIMEOUT_ENV = "TRIBUTARY_CONNECT_TIMEOUT"
DEFAULT_WEB_URL = "http://127.0.0.1:8000"

STDERR_TAIL_LINES = 40
ENGINE_STARTING = "starting the engine process"

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
    # Exit 0 is described only when the engine left without its final status: it means nothing then.
    meaning = EXIT_NAMES[code] if code in EXIT_NAMES and code != EXIT_SUCCEEDED else "unknown exit code"
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
        user_code: bool = False,
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
        # The web app let this run name its own reward code (a trusted team's admin launched it).
        self.user_code = bool(user_code)

        self.events_path = self.workdir / EVENTS_FILE
        self.engine_log_path = self.workdir / ENGINE_LOG_FILE
        self.proc: subprocess.Popen[bytes] | None = None
        self.shipper: EventShipper | None = None

        self._wake = threading.Event()
        self._decided = threading.Event()
        # "start", "skip" (final), "cancelled" (cancel pending before start) or "not claimed"
        self._decision = ""
        self._first_hello: Hello | None = None
        # Unique to this supervisor: of several holding copies of the run's queue message, the
        # web app lets one claim win (client/tributary/protocol.py), and only the winner starts the engine.
        self.claim_id = uuid.uuid4().hex
        self._claim_message = ""
        self._cancel = threading.Event()
        self._cancel_message = ""
        self._term_at: float | None = None
        self._killed = False
        self._log_start = 0

    # -- called from the shipper thread -------------------------------------------------------

    def _decide(self, decision: str) -> None:
        self._decision = decision
        self._decided.set()
        self._wake.set()

    def _on_hello(self, hello: Hello, first: bool) -> bool:
        if first:
            self._first_hello = hello
            if hello.status in FINAL_STATES:
                self._decide("skip")
                return False
            if not hello.raw.get(HELLO_CLAIMS):  # a web app that grants no claims: decide now
                self._decide("cancelled" if hello.cancel else "start")
            return True  # else the answer to the claim decides (_on_claim)
        if hello.cancel or hello.status in FINAL_STATES:
            self.cancel(f"the web app says the run is {hello.status or 'to be cancelled'}")
        return True

    def _on_claim(self, won: bool, message: str, first: bool) -> None:
        """The web app's answer to this supervisor's claim (on every connection)."""
        if not self._decided.is_set():
            hello = self._first_hello
            if won:
                self._decide("cancelled" if hello is not None and hello.cancel else "start")
            else:
                self._claim_message = message
                self._decide("not claimed")
        elif not won:  # a reconnect found the run held by another claim: this engine must stop
            self.cancel(f"the web app gave the run to another supervisor ({message})")

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
        # The seqs already in the run's log were written by an earlier engine (one lost with its
        # worker, whose tail nobody shipped): the web app stores them as that attempt's.
        attach = {"host": socket.gethostname(), "pid": os.getpid(), ATTACH_ENGINE_FROM: last_seq_in(self.events_path)}
        return EventShipper(
            self.web_url,
            self.run_id,
            self.token,
            self.events_path,
            on_hello=self._on_hello,
            on_cancel=self.cancel,
            on_claim=self._on_claim,
            claim=self.claim_id,
            **{"attach": attach, **self.shipper_options},
        )

    def _seq_floor(self) -> int:
        hello_seq = self._first_hello.last_seq if self._first_hello is not None else 0
        return max(self.start_seq, hello_seq)

    def _poll_stop_all(self) -> None:
        if _stop_all_requests and not self._cancel.is_set():
            self.cancel(_stop_all_requests[-1])

    def run(self) -> RunResult:
        """Supervise the run to its end (see the module docstring)."""
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
        if self._decision == "not claimed":
            # Another supervisor holds the run, or it went back to its queue behind older runs:
            # leave everything (its directory included) to whoever starts it.
            shipper.join(30)
            log.info("run %s: not started here: %s", self.run_id, self._claim_message)
            return RunResult(self.run_id, started=False, state="not claimed", error=self._claim_message)
        # Only now, with the run ours: its directory is written by the supervisor that starts it.
        config_path = self._prepare()
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

    def engine_command(self, config_path: Path, plan: ConfinementPlan) -> list[str]:
        cmd = [
            self.python, "-m", "jobs.launcher", str(os.getpid()), str(self.cancel_grace), plan.to_json(), "--",
            self.python, "-m", "engine", "run", str(config_path),
            "--events", str(self.events_path),
            "--run-id", str(self.run_id),
            "--start-seq", str(self._seq_floor()),
            "--progress", "off",
        ]  # fmt: skip
        if self.resume_path:
            cmd += ["--resume", str(self.resume_path)]
        return cmd

    def engine_env(self) -> dict[str, str]:
        """The engine's environment (``jobs/confine.py``): no credentials, its own reward policy.

        The worker's ``TRIBUTARY_REWARD_MODULES`` passes on; any other ``module:function`` is
        allowed only when the web app said so for this run."""
        policy = RewardPolicy.of_deployment(allow_any=self.user_code)
        fixed = {DATA_DIR_ENV: str(data_dir()), "PYTHONUNBUFFERED": "1", **policy.as_env()}
        if self.gpus is not None:  # only its own GPUs ("" keeps a CPU run off them)
            fixed["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        return engine_environment(os.environ, self.workdir, **fixed)

    def confinement(self) -> ConfinementPlan:
        """What the run may touch; required when it may run its own code or the deployment says so.

        A resume reads the checkpoint it starts from, which lies in another run's directory."""
        mode = confine_mode()
        grant = resume_grant(Path(self.resume_path), runs_dir()) if self.resume_path else None
        readable = [grant] if grant is not None else []
        plan = ConfinementPlan.for_run(
            self.workdir,
            data_dir=data_dir(),
            runs_dir=runs_dir(),
            readable=readable,
            required=mode == "require" or self.user_code,
        )
        if mode == "off":
            plan.hidden, plan.writable, plan.readable = [], [], []
            plan.required = False
        return plan

    def _say_how_confined(self, plan: ConfinementPlan) -> None:
        """One log event before the engine's own, so the run's page says how it is confined, and
        the status line says the engine is starting."""
        if not plan.hidden:
            level, message = "warning", "this run is not confined (TRIBUTARY_CONFINE=off): it can read the worker's files"
        elif landlock_abi() == 0:
            level, message = (
                ("error", "this run must be confined but the kernel has no Landlock: it will not start")
                if plan.required
                else ("warning", "this run is not confined: the kernel has no Landlock (environment scrubbed only)")
            )
        else:
            level, message = "info", (
                f"confined: {len(plan.hidden)} paths hidden (the web app's data, other runs), writes only "
                "its own directory and the caches; no capabilities; a scrubbed environment"
            )
        sink = EventSink(str(self.run_id), self.events_path, start_seq=self._seq_floor())
        try:
            sink.log(level, message)
            # The run's status line until the engine speaks (importing torch alone takes seconds):
            # the engine's own phases follow (engine/phases.py).
            sink.status("starting", ENGINE_STARTING)
        finally:
            sink.close()

    def _run_engine(self, config_path: Path, shipper: EventShipper) -> int:
        env = self.engine_env()
        plan = self.confinement()
        # Only what this engine writes counts when looking for its final status (a task
        # delivered again to this machine appends to the same log).
        self._log_start = self.events_path.stat().st_size if self.events_path.exists() else 0
        self._say_how_confined(plan)
        # The engine's output goes to the web app too, from where this engine's own begins.
        shipper.output = OutputLog(self.engine_log_path, self._output_start())
        with self.engine_log_path.open("ab") as out:
            self.proc = proc = subprocess.Popen(
                self.engine_command(config_path, plan),
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

    def _output_start(self) -> int:
        return self.engine_log_path.stat().st_size if self.engine_log_path.exists() else 0

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
        cancelled = self._cancel.is_set() and (code < 0 or code == EXIT_CANCELLED)
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


def resume_grant(resume_path: Path, runs: Path) -> Path | None:
    """What a resuming run may read of another run's directory: that run's ``checkpoints``, and
    only when the path lies there. A checkpoint path travels through the run's own events (which
    its code could forge), so a path elsewhere in the runs directory grants nothing (None: the
    engine then fails to read it, with the path in its error)."""
    try:
        relative = Path(os.path.realpath(resume_path)).relative_to(os.path.realpath(runs))
    except ValueError:
        return resume_path  # outside the runs directory: not hidden, nothing to grant
    if len(relative.parts) >= 2 and relative.parts[1] == "checkpoints":
        return runs / relative.parts[0] / "checkpoints"
    return None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
