"""The process supervisor behind ``python manage.py serve``: the whole platform on one machine.

It applies migrations, creates the demo data (``webapp/demo.py``: the ``admin`` login kept in
the data directory, team "Demo", project "Arithmetic" and, the first time only, one queued
DAPO run), then starts two child processes:

- the web server: ``uvicorn webapp.asgi:application --lifespan on`` (HTTP, the sockets and the
  lost-run sweeper);
- one Celery worker (``--pool solo``: one run at a time) on ``--queues``, with
  ``TRIBUTARY_WEB_URL`` pointing at that web server.

Their output is forwarded with a prefix. Once ``/health/`` answers, the URL and the login are
printed. Ctrl-C (SIGINT) or SIGTERM stops the worker first (its running engine checkpoints
and the worker ships the last events to the web server, which is still up), waiting up to
``--stop-timeout`` seconds before SIGKILL, then the web server; the exit code is 0. If either
child dies on its own, the other is stopped the same way and the exit code is 1.

The same command works with ``DATABASE_URL``/``REDIS_URL`` set (PostgreSQL and Redis are
then the servers'); in embedded mode (neither set) it needs no server at all. The management
command (``webapp.embedded.management.commands.serve``) only parses the options.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.urls import reverse

from jobs.confine import make_undumpable
from tributary.protocol import MAX_MESSAGE_BYTES

HEALTH_TIMEOUT_S = 120.0
WEB_STOP_TIMEOUT_S = 20.0
# uvicorn's own bound on closing open connections (browser sockets) when told to stop.
WEB_GRACEFUL_S = 10
# What a worker left running (an engine) gets this long to checkpoint after SIGTERM.
LEFTOVER_GRACE_S = 20.0


class Child:
    """A child process whose output is forwarded line by line with a prefix."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], out: TextIO, lock: threading.Lock):
        self.label = label
        self.argv = argv
        self.env = env
        self.out = out
        self.lock = lock
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "webapp.embedded.child", str(os.getpid()), *self.argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=settings.BASE_DIR,
            # Its own process group: Ctrl-C in the terminal reaches serve alone, which stops
            # the children in order (the worker must finish before the web server goes).
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._forward, name=f"serve-{self.label}", daemon=True)
        self.reader.start()

    def _forward(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        prefix = f"{self.label:<6} | "
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.lock:
                self.out.write(prefix + line + "\n")
                self.out.flush()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (its own children too, e.g. a run's engine)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def wait(self, timeout: float, give_up: threading.Event | None = None) -> bool:
        """Wait until the child exits (True), ``timeout`` passes or ``give_up`` is set (False)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.proc.wait(timeout=0.2)
                return True
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline or (give_up is not None and give_up.is_set()):
                    return False

    def finish_output(self) -> None:
        if self.reader is not None:
            self.reader.join(timeout=5)


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process from ``/proc``, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    if fields[0] == "Z":  # a zombie is gone already
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every live process below ``root`` (empty where /proc is missing)."""
    children: dict[int, list[tuple[int, int]]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _proc_stat(int(entry.name))
                if stat is not None:
                    children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: set[tuple[int, int]] = set()
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if (pid, start) not in found:
                found.add((pid, start))
                todo.append(pid)
    return found


def still_alive(processes: set[tuple[int, int]]) -> list[int]:
    """The pids of ``processes`` that still run (the same process: same start time)."""
    return sorted(pid for pid, start in processes if (_proc_stat(pid) or (0, -1))[1] == start)


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _url_host(host: str) -> str:
    """The host to connect to for a listen address (``0.0.0.0`` is reached as 127.0.0.1)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _check_port(host: str, port: int) -> None:
    """Refuse clearly when ``host:port`` cannot be listened on (taken, or not this machine's)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CommandError(
            f"--host {host!r} does not resolve here ({exc.strerror}): use e.g. 127.0.0.1"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As uvicorn binds: a port left in TIME_WAIT by a previous run is free, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CommandError(
                    f"port {port} on {host} is already taken (another Tributary, or another server): "
                    f"stop it, or choose another port with --port {port + 1}"
                ) from None
            if exc.errno == errno.EACCES:
                raise CommandError(
                    f"port {port} needs privileges here: use a port above 1023, e.g. --port 8000"
                ) from None
            raise CommandError(
                f"cannot listen on {host}:{port} ({exc.strerror}): check --host and --port"
            ) from None


def parse_queues(value: str) -> list[str]:
    names = [q.strip().lower() for q in value.split(",") if q.strip()]
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
    bad = [q for q in names if set(q) - allowed]
    if not names or bad:
        raise CommandError(
            f"--queues {value!r} is not a list of queue names: use comma-separated names like cpu or cpu,gpu"
        )
    return names


class Platform:
    """One ``serve``: the checks, the database, the demo data, then the two children until a
    signal or a child's exit, its messages and the children's output written to ``out``.
    Errors are ``CommandError`` with the exit code to leave with."""

    def __init__(
        self,
        out: TextIO,
        *,
        host: str,
        port: int,
        queues: list[str],
        demo: bool,
        stop_timeout: float,
        access_log: bool,
    ) -> None:
        self.stdout = out
        self._host, self._port, self._queues = host, port, queues
        self._with_demo, self._stop_timeout, self._access_log = demo, stop_timeout, access_log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._force = threading.Event()

    # ----------------------------------------------------------------------------- output
    def say(self, message: str) -> None:
        with self._lock:
            self.stdout.write(message if message.endswith("\n") else message + "\n")
            self.stdout.flush()

    # ----------------------------------------------------------------------------- main
    def run(self) -> None:
        make_undumpable()  # holds the environment (DATABASE_URL, REDIS_URL): out of the runs' reach
        host, port, queues = self._host, self._port, self._queues
        if not 0 < port < 65536:
            raise CommandError(f"--port {port} is not a port: use 1-65535, e.g. --port 8000")
        _check_port(host, port)
        try:
            self._migrate()
            demo = self._demo(queues) if self._with_demo else None
        except KeyboardInterrupt:
            raise CommandError(
                "interrupted before the servers started; nothing is running", returncode=130
            ) from None
        except OperationalError as exc:
            raise CommandError(
                f"cannot use the database ({self._database_label()}): {exc}".strip()
                + (": check DATABASE_URL and that the server is up" if os.environ.get("DATABASE_URL") else "")
            ) from None
        connections.close_all()  # the children open their own; serve no longer needs one
        for conn in connections.all(initialized_only=True):
            if getattr(conn, "pool", None) is not None:
                conn.close_pool()  # PostgreSQL's pool would keep DATABASE_POOL_MIN connections open

        web_url = f"http://{_url_host(host)}:{port}"
        env = self._child_env(web_url)
        web = Child("web", self._web_argv(host, port, self._access_log), env, self.stdout, self._lock)
        worker = Child(
            "worker", self._worker_argv(), self._worker_env(env, queues, port), self.stdout, self._lock
        )

        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        failure: str | None = None
        try:
            web.start()
            failure = self._wait_healthy(web, web_url)
            if failure is None and not self._stop.is_set():
                worker.start()
                self._banner(web_url, demo, queues, web, worker)
                failure = self._watch(web, worker)
        finally:
            forced = self._shutdown(web, worker, stop_timeout=self._stop_timeout)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if failure:
            raise CommandError(failure, returncode=1)
        if forced:
            raise CommandError(
                "stopped by force (a second Ctrl-C): a running run may be marked lost", returncode=130
            )
        self.say("Tributary stopped.")

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop.is_set():
            self._force.set()
            return
        self._stop.set()

    # ----------------------------------------------------------------------------- steps
    def _migrate(self) -> None:
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
        where = self._database_label()
        if pending:
            self.say(f"Database: {where}: applying {len(pending)} migration(s)...")
            call_command("migrate", interactive=False, verbosity=0)
        else:
            self.say(f"Database: {where}: up to date.")

    def _database_label(self) -> str:
        db = settings.DATABASES["default"]
        if connection.vendor == "sqlite":
            return f"SQLite {db['NAME']}"
        return f"{connection.vendor} {db.get('HOST') or 'localhost'}/{db['NAME']}"

    def _demo(self, queues: list[str]) -> Any:
        from webapp.demo import ensure_demo

        return ensure_demo(queue="cpu" if "cpu" in queues else queues[0])

    def _child_env(self, web_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env["TRIBUTARY_DATA_DIR"] = str(settings.DATA_DIR)  # the same data directory everywhere
        env["TRIBUTARY_WEB_URL"] = web_url
        env.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _web_argv(self, host: str, port: int, access_log: bool) -> list[str]:
        return [
            "-m", "uvicorn", "webapp.asgi:application",
            "--host", host,
            "--port", str(port),
            "--lifespan", "on",
            # Larger than the protocol's limit, so the app itself closes an oversized ingest
            # message with its own close code instead of uvicorn dropping the connection.
            "--ws-max-size", str(2 * MAX_MESSAGE_BYTES),
            "--timeout-graceful-shutdown", str(WEB_GRACEFUL_S),
            # Warnings and errors only (start-up failures still show); --access-log for requests.
            *(["--log-level", "info", "--access-log"] if access_log else ["--log-level", "warning", "--no-access-log"]),
        ]  # fmt: skip

    def _worker_argv(self) -> list[str]:
        # jobs.worker: celery worker on TRIBUTARY_QUEUES, pool solo, one run at a time (see _worker_env).
        return ["-m", "jobs.worker"]

    def _worker_env(self, env: dict[str, str], queues: list[str], port: int) -> dict[str, str]:
        return {
            **env,
            "TRIBUTARY_QUEUES": ",".join(queues),
            "TRIBUTARY_CONCURRENCY": "1",
            "TRIBUTARY_WORKER_NAME": f"serve-{port}@{socket.gethostname()}",
        }

    def _wait_healthy(self, web: Child, web_url: str) -> str | None:
        """None once ``/health/`` answers; else why not (the web server exited, or never answered)."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not self._stop.is_set():
            code = web.exit_code()
            if code is not None:
                return f"the web server exited during start-up ({_describe_exit(code)}): see its output above"
            try:
                with urllib.request.urlopen(f"{web_url}/health/", timeout=2) as response:
                    if response.status == 200:
                        return None
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                return f"the web server did not answer {web_url}/health/ within {HEALTH_TIMEOUT_S:.0f} s"
            self._stop.wait(0.2)
        return None

    def _banner(self, web_url: str, demo: Any, queues: list[str], web: Child, worker: Child) -> None:
        lines = ["", f"Tributary is up: {web_url}/"]
        if demo is not None:
            login = demo.login
            if login.password is not None:
                lines.append(f"  login      {login.username} / {login.password}   (kept in {login.path})")
            else:
                lines.append(f"  login      {login.username}: {login.note}")
            lines.append(f"  team       {demo.team.name}, project {demo.project.name} (id {demo.project.pk})")
            run = demo.run
            if run is not None:
                state = "queued now" if demo.run_created else f"from an earlier start, {run.status}"
                lines.append(f"  demo run   {web_url}{run.get_absolute_url()}   ({run.name}, {state})")
                lines.append(
                    f"             API: {web_url}{reverse('api:get_run', kwargs={'run_id': run.pk})}"
                )
            else:
                lines.append("  demo run   none (it was deleted): launch a new one from the project")
        else:
            lines.append("  no demo data (--no-demo): create a login with `python manage.py createsuperuser`")
        broker = (
            "Redis (REDIS_URL)" if os.environ.get("REDIS_URL", "").strip() else "files in the data directory"
        )
        lines += [
            f"  data       {settings.DATA_DIR}   (database: {self._database_label()}; broker: {broker})",
            f"  processes  web pid {web.pid}, worker pid {worker.pid} (queues: {', '.join(queues)})",
            "Press Ctrl-C to stop: the worker first (a running run checkpoints, to resume later), then the web server.",
            "",
        ]
        if os.environ.get("ALLOWED_HOSTS") is None and self._host not in {"127.0.0.1", "localhost", "::1"}:
            lines.insert(-1, "Note: set ALLOWED_HOSTS to the names browsers use to reach this machine.")
        self.say("\n".join(lines))

    def _watch(self, web: Child, worker: Child) -> str | None:
        """Wait for Ctrl-C/SIGTERM (None) or a child's own exit (the failure message)."""
        while not self._stop.wait(0.5):
            for child, name in ((web, "the web server"), (worker, "the Celery worker")):
                code = child.exit_code()
                if code is not None:
                    return f"{name} exited unexpectedly ({_describe_exit(code)}): see its output above; everything was stopped"
        return None

    def _shutdown(self, web: Child, worker: Child, *, stop_timeout: float) -> bool:
        """Stop the worker, then the web server; True when a second Ctrl-C forced it.

        The worker goes first: on SIGTERM it stops its run's engine (which checkpoints) and
        ships the last events to the web server, so the web server must still be up. Processes
        the worker started (a run's engine, in its own process group) are remembered before the
        worker is stopped, so none is left behind if the worker dies or is killed first.
        """
        if worker.running():
            self.say(
                f"Stopping the worker (up to {stop_timeout:.0f} s: a running run checkpoints and its last "
                "events reach the web server; Ctrl-C again to kill it now)..."
            )
            below = descendants(worker.pid)
            worker.signal(signal.SIGTERM)
            if not worker.wait(stop_timeout, give_up=self._force):
                below |= descendants(worker.pid)
                self.say("The worker did not stop in time: killing it (a running run will be marked lost).")
                worker.kill_group()
                for pid in still_alive(below):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            worker.wait(10)
            self._stop_leftovers(below)
        worker.finish_output()  # all of the worker's lines come before the web server's stop
        if web.running():
            self.say("Stopping the web server...")
            web.signal(signal.SIGTERM)
            if not web.wait(WEB_STOP_TIMEOUT_S, give_up=self._force):
                self.say("The web server did not stop in time: killing it.")
                web.kill_group()
            web.wait(10)
        web.finish_output()
        return self._force.is_set()

    def _stop_leftovers(self, processes: set[tuple[int, int]]) -> None:
        """SIGTERM (then SIGKILL) what the worker left running: an engine checkpoints on SIGTERM."""
        left = still_alive(processes)
        if not left:
            return
        self.say(f"Stopping what the worker left running (pids {', '.join(map(str, left))})...")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while still_alive(processes) and time.monotonic() < deadline and not self._force.is_set():
            time.sleep(0.2)
        for pid in still_alive(processes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
