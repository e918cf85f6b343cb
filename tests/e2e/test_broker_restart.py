"""Fault test: the Redis broker restarted (no persistence) with one run running and one queued.

Real processes: a Redis server of the test's own on a free port (the broker and the channel
layer), uvicorn serving the web app (SQLite), one Celery worker. Redis is killed and started
again empty while the first run trains and the second waits in the queue; a third run is
launched right after. Afterwards:

- the running run finished, and what the web app stored equals the engine's log (none lost,
  none twice);
- the queued run, whose message Redis forgot, was sent again by the reconciler and finished;
- the run launched after the restart did not start ahead of it;
- no run started twice (one engine ``starting`` status per run).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.supervisor import ENGINE_STARTING
from tests.e2e.harness import (
    Deployment,
    assert_stored_matches,
    free_port,
    launch,
    scratch_postgres,
    wait_until,
)
from tests.tiny_runs import tiny_config
from webapp.runs.reconcile import SEND_GRACE_S, run_of_message

pytestmark = pytest.mark.slow


class RedisServer:
    """A ``redis-server`` of the test's own, without persistence: a restart empties it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH: install Debian's redis-server (the test machine has it)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = (self.root / f"redis-{self.starts}.log").open("ab")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_until(self._ready, f"redis-server on port {self.port}", timeout=60)
        return self

    def _ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=2).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


def engine_starts(d: Deployment, run_id: int) -> int:
    """How many engines ran this run: its supervisor writes one ``ENGINE_STARTING`` status before
    each (the engine's own preparing phases are ``starting`` statuses too, several per engine)."""
    return sum(1 for e in d.engine_log(run_id) if e["type"] == "status" and e.get("message") == ENGINE_STARTING)


def test_a_broker_restart_loses_no_queued_run_and_keeps_the_order(
    redis_server: RedisServer, deployment, tiny_model_dir: Path
) -> None:
    d = deployment(REDIS_URL=redis_server.url, RECONCILE_EVERY="1")
    ids = d.setup()
    d.start_web()
    d.start_worker()  # one run at a time
    running = launch(d, ids["project"], tiny_config(tiny_model_dir, total_steps=60, name="running"))
    wait_until(lambda: d.run(running)["status"] == "running", "the first run to start", every=0.3)
    queued = launch(d, ids["project"], tiny_config(tiny_model_dir, total_steps=3, name="queued"))
    assert redis_server.client().llen("cpu") == 1  # its message waits in the queue
    wait_until(lambda: d.run(running)["last_step"] >= 3, "the first run to train", every=0.3)

    redis_server.kill()  # the broker forgets the queued run's message, and everything else
    redis_server.start()
    assert redis_server.client().llen("cpu") == 0
    later = launch(d, ids["project"], tiny_config(tiny_model_dir, total_steps=3, name="later"))

    runs = {
        run_id: d.wait_status(run_id, "succeeded", "failed", "cancelled", "lost")
        for run_id in (running, queued, later)
    }
    assert [runs[r]["status"] for r in (running, queued, later)] == ["succeeded"] * 3, d.logs()

    # The queued run started before the one launched after the restart (one worker: after it ended).
    assert runs[queued]["started_at"] < runs[later]["started_at"]
    assert runs[queued]["finished_at"] <= runs[later]["started_at"]
    for run_id, run in runs.items():
        log = d.engine_log(run_id)
        assert engine_starts(d, run_id) == 1, f"run {run_id} started {engine_starts(d, run_id)} times"
        assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
        assert run["last_seq"] == log[-1]["seq"]
        assert_stored_matches(d.stored(run_id), log, run["last_seq"])

    web_log = (d.root / "web.log").read_text(errors="replace")
    assert f"run {queued} (queue cpu): its queue message is gone" in web_log, (
        "the reconciler did not re-send it"
    )


@pytest.fixture
def postgres_database() -> Iterator[str]:
    with scratch_postgres("tributary_e2e") as url:
        yield url


def test_two_web_replicas_send_each_lost_run_once_oldest_first(
    redis_server: RedisServer, postgres_database: str, deployment, tiny_model_dir: Path
) -> None:
    """Two web processes on one PostgreSQL reconcile every second, no worker: queued runs keep
    their one message each, pass after pass; after a restart each is sent again once, oldest
    first, whichever replica noticed."""
    settings = {"REDIS_URL": redis_server.url, "RECONCILE_EVERY": "1", "DATABASE_URL": postgres_database}
    replicas = [deployment(**settings), deployment(**settings)]
    ids = replicas[0].setup()
    replicas[1].api_token = replicas[0].api_token
    for d in replicas:
        d.start_web()
    first = launch(replicas[0], ids["project"], tiny_config(tiny_model_dir, total_steps=1, name="first"))
    second = launch(replicas[1], ids["project"], tiny_config(tiny_model_dir, total_steps=1, name="second"))
    client = redis_server.client()
    assert client.llen("cpu") == 2

    def sent_again(run_id: int) -> int:
        text = (replicas[0].root / "web.log").read_text(errors="replace")  # both replicas write there
        return text.count(f"run {run_id} (queue cpu): its queue message is gone")

    # Once the runs are past the send grace, every pass of both replicas looks at them, and
    # must leave them alone: their messages are there.
    time.sleep(SEND_GRACE_S + 3)
    assert client.llen("cpu") == 2
    assert sent_again(first) == sent_again(second) == 0

    redis_server.kill()
    redis_server.start()
    client = redis_server.client()
    wait_until(
        lambda: client.llen("cpu") >= 2, "a replica to send both runs again", timeout=SEND_GRACE_S + 120
    )
    time.sleep(3)  # a few more passes of both: they must send nothing more
    # kombu pushes on the left and a worker pops on the right: the oldest message is the last element.
    order = [run_of_message(raw) for raw in reversed(client.lrange("cpu", 0, -1))]
    assert order == [first, second], order
    assert sent_again(first) == sent_again(second) == 1
