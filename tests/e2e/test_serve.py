"""The README's run command end to end: ``manage.py serve`` as a real process, twice.

Embedded mode (no DATABASE_URL, no REDIS_URL) in a fresh data directory whose ``starter``
is the test session's cached starter policy (``tests/conftest.py``), so the demo run does not
build it again. First start: migrations, the demo login, team, project and one queued demo
run, a web server and a worker; the run reaches ``running``; Ctrl-C (SIGINT) stops the worker
first, so the run ends ``cancelled`` with a checkpoint, then the web server; exit code 0 and no
process left. Second start on the same data: the same login, the same single demo run, which
resumes from its checkpoint on the new worker (the same run, its next attempt).

Time limits here only keep a broken build from hanging; nothing asserts how fast anything is.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.starter("arithmetic")]

STARTUP_TIMEOUT = 300.0  # migrations, uvicorn and Celery start-up on a busy 2-core machine
RUNNING_TIMEOUT = 300.0  # the engine loads the starter policy, evaluates step 0, trains a step
STOP_TIMEOUT = 240.0  # serve's own bounds: 60 s for the worker, 20 s for the web server


def _stat(pid: int | str) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]; index 19 is the start time."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def proc_tree(root: int) -> dict[int, tuple[str, str]]:
    """pid -> (command line, start time) of every live process below ``root``.

    The start time (in clock ticks since boot) tells a process from a later one that reuses its
    pid; the command line alone cannot, since Celery retitles its worker when setproctitle is
    installed (vLLM brings it in): ``[celeryd: tributary@host:MainProcess] ...``.
    """
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = _stat(entry.name)
                if stat[0] != "Z":
                    parent_of[int(entry.name)] = int(stat[1])
    found: dict[int, tuple[str, str]] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parent_of.items():
            if ppid == parent and pid not in found:
                with contextlib.suppress(OSError, IndexError):
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    found[pid] = (cmdline, _stat(pid)[19])
                    todo.append(pid)
    return found


def alive(pid: int, started: str) -> bool:
    """The same process still runs (same pid and start time, not a zombie)."""
    try:
        stat = _stat(pid)
    except (OSError, IndexError):
        return False
    return stat[0] != "Z" and stat[19] == started


def is_worker(cmdline: str) -> bool:
    """``python -m jobs.worker``, or the same process once Celery has retitled it."""
    return "jobs.worker" in cmdline or "[celeryd: " in cmdline


class Serve:
    """``manage.py serve`` in a subprocess; its output collected line by line."""

    def __init__(self, data_dir: Path, port: int, steps: int) -> None:
        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"}}
        env.update(
            TRIBUTARY_DATA_DIR=str(data_dir),
            TRIBUTARY_DEMO_STEPS=str(steps),
            PYTHONUNBUFFERED="1",
        )
        self.port = port
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)
        self._new.put(None)

    def output(self, last: int = 80) -> str:
        return "\n".join(self.lines[-last:])

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern`` (already printed or still to come)."""
        regex = re.compile(pattern)
        for line in list(self.lines):
            if match := regex.search(line):
                return match
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._new.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(
                    f"serve exited ({self.proc.wait()}) before printing {pattern!r}:\n{self.output()}"
                )
            if match := regex.search(line):
                return match
        pytest.fail(f"serve did not print {pattern!r} in time:\n{self.output()}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"serve did not stop after SIGINT:\n{self.output()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in proc_tree(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()


class Browser:
    """A session through Django's login page, then the JSON API with the session cookie."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def cookie(self, name: str) -> str:
        return next(c.value for c in self.jar if c.name == name)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if method not in {"GET", "HEAD"}:
            headers["X-CSRFToken"] = self.cookie("csrftoken")
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with self.opener.open(req, timeout=30) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read(), exc.code
        with contextlib.suppress(ValueError):
            return status, json.loads(raw)
        return status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def login(self, username: str, password: str) -> None:
        with self.opener.open(f"{self.base}/admin/login/", timeout=30) as response:
            page = response.read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, page[:500]
        form = urllib.parse.urlencode(
            {
                "username": username,
                "password": password,
                "csrfmiddlewaretoken": token.group(1),
                "next": "/admin/",
            }
        ).encode()
        with self.opener.open(
            urllib.request.Request(f"{self.base}/admin/login/", data=form), timeout=30
        ) as response:
            assert response.url.rstrip("/").endswith("/admin"), f"login refused: ended on {response.url}"
        assert any(c.name == "sessionid" for c in self.jar)

    def wait_training(
        self, run_id: int, serve: Serve, timeout: float, *, after_step: int = 0
    ) -> dict[str, Any]:
        """The run once it is ``running`` and has trained past ``after_step`` (so a stop checkpoints)."""
        deadline = time.monotonic() + timeout
        run: dict[str, Any] = {}
        while time.monotonic() < deadline:
            run = self.get(f"/api/runs/{run_id}")
            if run["status"] == "running" and run["last_step"] > after_step:
                return run
            assert run["status"] in {"queued", "starting", "running"}, (run, serve.output())
            time.sleep(0.5)
        pytest.fail(
            f"run {run_id} is {run.get('status')!r} at step {run.get('last_step')}, never running past step "
            f"{after_step}:\n{serve.output()}"
        )


BANNER_URL = r"Tributary is up: (http://\S+)/$"
BANNER_LOGIN = r"^\s+login\s+(\S+) / (\S+)\s"
BANNER_RUN = r"^\s+demo run\s+http://\S+/runs/(\d+)/\s+\((\S+), (.*)\)$"


@pytest.fixture
def data_dir(tmp_path: Path, tributary_data_dir: Path) -> Path:
    """A fresh data directory sharing the session's starter policy (built once if missing)."""
    from engine.models import starter_policy
    from engine.paths import starter_dir

    starter_policy("arithmetic", 1)
    data = tmp_path / "data"
    data.mkdir()
    (data / "starter").symlink_to(starter_dir(), target_is_directory=True)
    return data


def test_serve_runs_the_demo_stops_cleanly_and_reuses_its_data(data_dir: Path) -> None:
    # ---- first start: a fresh data directory ------------------------------------------------
    serve = Serve(data_dir, free_port(), steps=10_000)
    try:
        url = serve.wait_for(BANNER_URL, STARTUP_TIMEOUT).group(1)
        username, password = serve.wait_for(BANNER_LOGIN, 5).groups()
        run_id, run_name, run_state = serve.wait_for(BANNER_RUN, 5).groups()
        run_id = int(run_id)
        assert (username, run_name, run_state) == ("admin", "demo-dapo", "queued now")
        assert url == f"http://127.0.0.1:{serve.port}"
        assert f"API: {url}/api/runs/{run_id}" in serve.output()

        login_file = data_dir / "demo_login"
        assert login_file.stat().st_mode & 0o777 == 0o600
        assert password in login_file.read_text()
        assert (data_dir / "secret_key").stat().st_mode & 0o777 == 0o600

        with urllib.request.urlopen(f"{url}/health/", timeout=30) as response:
            assert json.loads(response.read()) == {"status": "ok", "database": "sqlite"}

        browser = Browser(url)
        browser.login(username, password)
        me = browser.get("/api/me")
        assert me["username"] == "admin"
        assert [(t["name"], t["role"]) for t in me["teams"]] == [("Demo", "admin")]

        run = browser.get(f"/api/runs/{run_id}")
        assert run["config"]["trainer"]["total_steps"] == 10_000
        assert run["config"]["data"]["task"] == "arithmetic" and run["config"]["model"]["path"] == "starter"
        project_id = run["project_id"]
        assert browser.get(f"/api/projects/{project_id}/runs")["total"] == 1

        browser.wait_training(run_id, serve, RUNNING_TIMEOUT)  # one step trained: a stop checkpoints
        tree = proc_tree(serve.proc.pid)
        commands = [cmd for cmd, _ in tree.values()]
        assert any("uvicorn" in cmd for cmd in commands), tree
        assert any(is_worker(cmd) for cmd in commands), tree
        assert any("engine run" in cmd for cmd in commands), tree

        # ---- Ctrl-C: the worker (and its engine) first, then the web server -----------------
        code = serve.stop()
        out = serve.output(200)
        assert code == 0, out
        assert "Tributary stopped." in out
        assert not [pid for pid, (_, started) in tree.items() if alive(pid, started)], (tree, out)
        # The worker's output (its last shipped events included) all came before the web server stopped.
        lines = serve.lines
        web_stop = next(i for i, line in enumerate(lines) if line.startswith("Stopping the web server"))
        worker_stop = next(i for i, line in enumerate(lines) if line.startswith("Stopping the worker"))
        assert worker_stop < web_stop
        assert max(i for i, line in enumerate(lines) if line.startswith("worker |")) < web_stop
    finally:
        serve.kill()

    # ---- second start on the same data ------------------------------------------------------
    again = Serve(data_dir, free_port(), steps=10_000)
    try:
        url = again.wait_for(BANNER_URL, STARTUP_TIMEOUT).group(1)
        assert again.wait_for(BANNER_LOGIN, 5).groups() == (username, password)
        same_id, same_name, state = again.wait_for(BANNER_RUN, 5).groups()
        assert (int(same_id), same_name) == (run_id, "demo-dapo")
        assert state == "from an earlier start, cancelled"
        assert "applying" not in again.output()  # migrations were applied the first time

        browser = Browser(url)
        browser.login(username, password)  # the session secret survived: the same key file
        run = browser.get(f"/api/runs/{run_id}")
        assert run["status"] == "cancelled", run
        assert run["checkpoint_count"] >= 1, run
        checkpoints = browser.get(f"/api/runs/{run_id}/checkpoints")
        assert checkpoints and all(Path(c["path"]).is_dir() for c in checkpoints), checkpoints
        assert browser.get(f"/api/projects/{project_id}/runs")["total"] == 1  # no second demo run

        # The checkpoint written on Ctrl-C resumes on the new worker: the same run, its next attempt.
        status, resumed = browser.request("POST", f"/api/runs/{run_id}/resume", {})
        assert status == 200, resumed
        assert resumed["id"] == run_id and len(resumed["attempts"]) == 2
        resumed = browser.wait_training(run_id, again, RUNNING_TIMEOUT, after_step=run["last_step"])
        assert resumed["status"] == "running"

        assert again.stop() == 0, again.output(200)
    finally:
        again.kill()
