"""Real processes for end-to-end tests: uvicorn serving ``webapp.asgi``, a Celery worker
(``python -m jobs.worker``), the JSON API over HTTP with a personal token, and a browser-like
WebSocket client. Embedded mode (SQLite file, file broker) in a temporary data directory,
with settings passed as environment variables exactly as a deployment would.

Time limits only keep a broken build from hanging; tests never assert durations.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

WAIT = 240.0  # generous: a loaded 2-core machine starts uvicorn, Celery and torch slowly


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], Any], what: str, timeout: float = WAIT, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


_MIGRATED: list[Path] = []
_MIGRATED_LOCK = threading.Lock()


def migrated_sqlite() -> Path:
    """A SQLite database ``manage.py migrate`` made in this test process, once (the first
    deployment's ``setup`` pays for it): every later deployment starts from a copy. The schema
    and what migrations insert (content types, permissions) depend on the code alone: no
    migration reads a setting but ``AUTH_USER_MODEL``, which no deployment changes, so a copy is
    the database a migrate of its own would make. A data directory of its own, outside every
    test's, keeps it from being written to."""
    with _MIGRATED_LOCK:
        if not _MIGRATED:
            import atexit
            import shutil
            import tempfile

            root = Path(tempfile.mkdtemp(prefix="tributary-migrated-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            Deployment(root).manage("migrate", "--verbosity", "0")
            _MIGRATED.append(root / "data" / "tributary.sqlite3")
        return _MIGRATED[0]


def copy_sqlite(source: Path, target: Path) -> None:
    """``source`` copied to ``target`` through SQLite's backup API (consistent whatever its
    journal mode; the settings put every connection in WAL mode again)."""
    with contextlib.closing(sqlite3.connect(source)) as src, contextlib.closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


class Deployment:
    """One data directory, one web port; web and worker processes started and killed at will."""

    def __init__(self, root: Path, **settings: str) -> None:
        self.root = root
        self.data = root / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"}}
        self.env.update(
            TRIBUTARY_DATA_DIR=str(self.data),
            TRIBUTARY_WEB_URL=self.url,
            SECRET_KEY="e2e-" + "k" * 40,
            PYTHONUNBUFFERED="1",
            **settings,
        )
        self.web: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.api_token = ""

    # -- processes -------------------------------------------------------------------------
    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def migrate(self) -> None:
        """The database migrated: on SQLite, a copy of the one this test process migrated first
        (``migrated_sqlite``); on PostgreSQL (``DATABASE_URL`` set), ``manage.py migrate``."""
        target = self.data / "tributary.sqlite3"
        if self.env.get("DATABASE_URL") or target.exists():
            self.manage("migrate", "--verbosity", "0")
            return
        self.data.mkdir(parents=True, exist_ok=True)
        copy_sqlite(migrated_sqlite(), target)

    def setup(self, then: str = "") -> dict[str, int]:
        """Migrate; a user with an API token, admin of a team with one project. ``then``: more
        Python for the same ``manage.py shell`` (one Django start-up fewer than a shell of its
        own), with ``user``, ``team`` and ``project`` at hand; what it puts in the dict ``out``
        is returned with the project's id."""
        self.migrate()
        out = self.manage(
            "shell",
            "-c",
            "import json\n"
            "from django.contrib.auth import get_user_model\n"
            "from webapp.api.models import ApiToken\n"
            "from webapp.teams.models import Project\n"
            "from webapp.teams.services import create_team\n"
            "user = get_user_model().objects.create_user('e2e')\n"
            "team = create_team('E2E', user)\n"
            "project = Project.objects.create(team=team, name='Faults', slug='faults')\n"
            "_, plain = ApiToken.issue(user, 'e2e')\n"
            "out = {'project': project.pk, 'token': plain}\n"
            f"{then}\n"
            "print(json.dumps(out))\n",
        )
        ids = json.loads(out.strip().splitlines()[-1])
        self.api_token = ids.pop("token")
        return ids

    def start_web(self) -> None:
        log = (self.root / "web.log").open("ab")
        self.web = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--port", str(self.port),
             "--lifespan", "on", "--log-level", "warning", "--ws-max-size", str(16 * 1024 * 1024)],
            cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_until(self._healthy, "the web app's /health/")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health/", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def kill_web(self) -> None:
        assert self.web is not None
        self.web.send_signal(signal.SIGKILL)
        self.web.wait(timeout=30)

    def start_worker(self) -> subprocess.Popen[bytes]:
        log = (self.root / f"worker-{len(self.workers)}.log").open("ab")
        worker = subprocess.Popen(
            [sys.executable, "-m", "jobs.worker", "-n", f"e2e{len(self.workers)}@%h"],
            cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.workers.append(worker)
        return worker

    def stop_all(self) -> None:
        for proc in [*self.workers, self.web]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.root.glob("*.log")))

    # -- the API ---------------------------------------------------------------------------
    def api(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            f"{self.url}/api{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.api_token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: {exc.code} {exc.read()[:2000]!r}") from None

    def run(self, run_id: int) -> dict[str, Any]:
        return self.api("GET", f"/runs/{run_id}")

    def wait_status(self, run_id: int, *statuses: str, timeout: float = WAIT) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            try:
                run = self.run(run_id)
            except (AssertionError, OSError):
                return None  # the web app is restarting
            return run if run["status"] in statuses else None

        return wait_until(reached, f"run {run_id} to become {' or '.join(statuses)}", timeout, every=0.5)

    # -- what is stored, and what the engine wrote ------------------------------------------
    def stored(self, run_id: int) -> dict[int, tuple[str, int]]:
        """seq -> (kind, rows) for every row-backed event the web app stored for the run."""
        with sqlite3.connect(self.data / "tributary.sqlite3") as db:
            out: dict[int, tuple[str, int]] = {}
            for kind, table in (("metrics", "runs_metricpoint"), ("samples", "runs_sample"),
                                ("checkpoint", "runs_checkpoint"), ("log", "runs_logline")):  # fmt: skip
                for seq, rows in db.execute(f"SELECT seq, COUNT(*) FROM {table} WHERE run_id = ? GROUP BY seq", (run_id,)):
                    assert seq not in out, f"seq {seq} stored as {out[seq][0]} and {kind}"
                    out[seq] = (kind, rows)
            return out

    def engine_log(self, run_id: int) -> list[dict[str, Any]]:
        path = self.data / "runs" / str(run_id) / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@contextlib.contextmanager
def scratch_postgres(prefix: str) -> Iterator[str]:
    """The URL of a database of its own on the machine's PostgreSQL (``TEST_POSTGRES_URL``,
    default the local server), dropped afterwards. No server is a failure, not a skip: the test
    machine has one (``.ci/run`` starts it)."""
    import psycopg

    server = os.environ.get("TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    name = f"{prefix}_{os.getpid()}_{int(time.time() * 1000) % 10**8}"
    try:
        admin = psycopg.connect(server, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"no PostgreSQL at {server} ({exc}): start it (.ci/run does) or set TEST_POSTGRES_URL")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield server.rsplit("/", 1)[0] + "/" + name
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def launch(d: Deployment, project: int, config: dict[str, Any]) -> int:
    """Launch ``config`` in ``project`` through the API; the run's id."""
    return d.api("POST", f"/projects/{project}/runs", {"config": config, "name": config["name"]})["id"]


def row_backed(events: list[dict[str, Any]], upto_seq: int | None = None) -> dict[int, tuple[str, int]]:
    """What ``Deployment.stored`` must hold for these engine events (seq -> kind, rows)."""
    out: dict[int, tuple[str, int]] = {}
    for event in events:
        if upto_seq is not None and event["seq"] > upto_seq:
            continue
        kind = event["type"]
        if kind == "metrics":
            rows = sum(value is not None for value in event["values"].values())
            if rows:
                out[event["seq"]] = (kind, rows)
        elif kind == "samples" and event["items"]:
            out[event["seq"]] = (kind, len(event["items"]))
        elif kind in ("checkpoint", "log"):
            out[event["seq"]] = (kind, 1)
    return out


def assert_stored_matches(stored: dict[int, tuple[str, int]], events: list[dict[str, Any]], upto_seq: int) -> None:
    """Every row-backed engine event up to ``upto_seq`` is stored once with all its rows, and
    nothing else is (but for a status event the run refused, kept as a warning log line)."""
    expected = row_backed(events, upto_seq)
    missing = {seq: want for seq, want in expected.items() if stored.get(seq) != want}
    assert not missing, f"missing or partial: {dict(list(missing.items())[:10])} (stored {[stored.get(s) for s in list(missing)[:10]]})"
    status_seqs = {e["seq"] for e in events if e["type"] == "status"}
    extra = {seq: got for seq, got in stored.items() if seq not in expected}
    assert all(seq in status_seqs and got == ("log", 1) for seq, got in extra.items()), extra


class Browser:
    """A browser on the run socket through a share link: reconnects with ``after_seq`` = the
    highest seq it has, as the run page does, and keeps every event it receives."""

    def __init__(self, deployment: Deployment, run_id: int, share_token: str) -> None:
        self.deployment, self.run_id, self.share = deployment, run_id, share_token
        self.events: list[dict[str, Any]] = []
        self.cursor = 0  # the last_seq of the latest events message: where to reconnect from
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> Browser:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _main(self) -> None:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        while not self._stop.is_set():
            url = (
                f"ws://127.0.0.1:{self.deployment.port}/ws/runs/{self.run_id}/"
                f"?after_seq={self.cursor}&share={self.share}"
            )
            try:
                with connect(url, origin=f"http://127.0.0.1:{self.deployment.port}", open_timeout=5, max_size=None) as ws:
                    self.connections += 1
                    while not self._stop.is_set():
                        try:
                            message = json.loads(ws.recv(timeout=0.5))
                        except TimeoutError:
                            continue
                        if message["type"] == "events":
                            self.events.extend(message["events"])
                            self.cursor = message["last_seq"]
            except (OSError, ConnectionClosed, TimeoutError):
                time.sleep(0.3)  # the web app is down: try again
