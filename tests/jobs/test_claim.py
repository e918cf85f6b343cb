"""Exclusive claims through the real web app (uvicorn, SQLite, the embedded file broker) and real
sockets: of several supervisors holding copies of one run's queue message, one starts the engine.

No worker runs here: each test reads the run's queue message (with its ingest token) from the
broker folder, as a worker would receive it, and plays the supervisors itself.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

from jobs.app import SUPERVISE_TASK
from jobs.supervisor import ENGINE_STARTING, RUNS_DIR_ENV, RunResult, RunSupervisor
from tests.e2e.harness import Deployment, assert_stored_matches, scratch_postgres
from tests.tiny_runs import tiny_config
from tributary.protocol import HELLO_CLAIMS, MSG_CLAIM
from tributary.shipper import ingest_url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def web(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The web app on SQLite, then on a database of its own on the machine's PostgreSQL
    (``TEST_POSTGRES_URL``, default the local server; skipped when there is none)."""
    with contextlib.ExitStack() as stack:
        settings = {}
        if request.param == "postgresql":
            settings["DATABASE_URL"] = stack.enter_context(scratch_postgres("tributary_claims"))
        d = Deployment(tmp_path_factory.mktemp(f"claims-{request.param}"), **settings)
        ids = d.setup()
        d.start_web()
        yield d, ids["project"]
        d.stop_all()
        print(d.logs())


def messages(d: Deployment, run_id: int) -> list[dict[str, Any]]:
    """The kwargs of every queue message for ``run_id`` waiting in the broker folder, oldest first."""
    out = []
    for path in sorted((d.data / "broker" / "queue").glob("*.msg")):
        message = json.loads(path.read_bytes())
        if message["headers"]["task"] != SUPERVISE_TASK:
            continue
        _args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        if kwargs["run_id"] == run_id:
            out.append(kwargs)
    return out


def stored(d: Deployment, run_id: int) -> dict[int, tuple[str, int]]:
    """``Deployment.stored`` (seq -> kind, rows), on PostgreSQL too."""
    if "DATABASE_URL" not in d.env:
        return d.stored(run_id)
    import psycopg

    out: dict[int, tuple[str, int]] = {}
    with psycopg.connect(d.env["DATABASE_URL"]) as db:
        for kind, table in (("metrics", "runs_metricpoint"), ("samples", "runs_sample"),
                            ("checkpoint", "runs_checkpoint"), ("log", "runs_logline")):  # fmt: skip
            for seq, rows in db.execute(
                f"SELECT seq, COUNT(*) FROM {table} WHERE run_id = %s GROUP BY seq", (run_id,)
            ):
                assert seq not in out, f"seq {seq} stored as {out[seq][0]} and {kind}"
                out[seq] = (kind, rows)
    return out


def launch(d: Deployment, project: int, config: dict[str, Any]) -> int:
    return d.api("POST", f"/projects/{project}/runs", {"config": config, "name": config["name"]})["id"]


class Socket:
    """A worker's ingest socket, driven by hand."""

    def __init__(self, d: Deployment, run_id: int, token: str) -> None:
        self.ws = connect(
            ingest_url(d.url, run_id),
            additional_headers={"Authorization": f"Bearer {token}"},
            open_timeout=30,
            legacy=True,
        )
        self.hello = json.loads(self.ws.recv(timeout=30))

    def claim(self, claim: str, host: str = "box") -> dict[str, Any]:
        self.ws.send(json.dumps({"type": "attach", "host": host, "pid": 1, "claim": claim}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message["type"] == MSG_CLAIM:
                return message

    def close(self) -> None:
        self.ws.close()


def test_one_claim_wins_and_its_reconnect_keeps_the_run(web: Any, tiny_model_dir: Path) -> None:
    d, project = web
    run_id = launch(d, project, tiny_config(tiny_model_dir, total_steps=1, name="claimed"))
    token = messages(d, run_id)[-1]["token"]

    first = Socket(d, run_id, token)
    assert first.hello["type"] == "hello" and first.hello[HELLO_CLAIMS] is True
    assert first.claim("claim-a", host="gpu-1") == {"type": MSG_CLAIM, "won": True, "message": ""}
    second = Socket(d, run_id, token)  # a second copy of the message, another supervisor
    lost = second.claim("claim-b", host="gpu-2")
    assert lost["won"] is False and "another claim" in lost["message"]
    second.close()
    run = d.run(run_id)
    assert (run["status"], run["worker_host"]) == ("starting", "gpu-1")

    first.close()  # the winner's connection drops; it reconnects with the same claim
    again = Socket(d, run_id, token)
    assert again.hello["status"] == "starting"
    assert again.claim("claim-a", host="gpu-1")["won"] is True
    again.close()
    bad = Socket(d, run_id, token)
    bad.ws.send(json.dumps({"type": "attach", "host": "x", "claim": ["not", "a", "string"]}))
    error = json.loads(bad.ws.recv(timeout=30))
    assert error["type"] == "error" and "'claim' must be a string" in error["message"]


def test_of_two_supervisors_with_the_same_message_one_starts_the_engine(
    web: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, project = web
    monkeypatch.setenv(RUNS_DIR_ENV, str(d.data / "runs"))
    run_id = launch(d, project, tiny_config(tiny_model_dir, total_steps=2, name="twice"))
    kwargs = messages(d, run_id)[-1]
    supervisors = [
        RunSupervisor(
            run_id,
            kwargs["config"],
            kwargs["token"],
            start_seq=kwargs["start_seq"],
            web_url=d.url,
            connect_timeout=120,
            drain_timeout=120,
        )
        for _ in range(2)
    ]
    results: list[RunResult] = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.run())) for s in supervisors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(results) == 2, "a supervisor did not finish"

    winner = [r for r in results if r.started]
    loser = [r for r in results if not r.started]
    assert len(winner) == 1 and len(loser) == 1, results
    assert winner[0].state == "succeeded" and winner[0].drained
    assert loser[0].state == "not claimed" and "another claim" in loser[0].error
    run = d.wait_status(run_id, "succeeded", "failed")
    log = d.engine_log(run_id)
    # One engine ran: its supervisor said once that it starts it, one chain of seqs from 1.
    assert [e["message"] for e in log if e["type"] == "status"].count(ENGINE_STARTING) == 1
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert run["status"] == "succeeded" and run["last_seq"] == log[-1]["seq"]
    assert_stored_matches(stored(d, run_id), log, run["last_seq"])


def test_a_newer_run_does_not_start_ahead_of_an_older_one_waiting_behind_it(
    web: Any, tiny_model_dir: Path
) -> None:
    """A message sent again (a reconciler's re-send) lands behind newer runs' messages: when a
    newer run is claimed while an older one of its queue still waits, the newer one goes back."""
    d, project = web
    older = launch(d, project, tiny_config(tiny_model_dir, total_steps=1, name="older"))
    newer = launch(d, project, tiny_config(tiny_model_dir, total_steps=1, name="newer"))
    newer_socket = Socket(d, newer, messages(d, newer)[-1]["token"])
    refused = newer_socket.claim("newer-1")
    newer_socket.close()
    assert refused["won"] is False and f"run(s) {older}" in refused["message"]
    assert len(messages(d, newer)) == 2, "the newer run was not queued again"
    assert d.run(newer)["status"] == "queued"

    older_socket = Socket(d, older, messages(d, older)[-1]["token"])
    assert older_socket.claim("older-1")["won"] is True
    # The older run started: the newer one's next copy may start now.
    newer_again = Socket(d, newer, messages(d, newer)[-1]["token"])
    assert newer_again.claim("newer-2")["won"] is True
    older_socket.close()
    newer_again.close()
    for run_id in (older, newer):  # leave nothing in flight for the next test
        d.api("POST", f"/runs/{run_id}/cancel")
