"""Poison events through real processes (issue 13, item 3): uvicorn serving the web app and,
for the full run, a Celery worker starting the engine. One bad event used to stall a run's
ingest for good (PostgreSQL's jsonb and text refuse NUL; the batch failed, the socket closed
with 1011, the worker resent forever). Now every input below ends with the run complete and
every storable event stored, seq by seq; what cannot be stored is an error log line in its
place.

Embedded mode (SQLite) by default; with ``DATABASE_URL`` pointing at a PostgreSQL server (the
PostgreSQL pass), the deployment gets a database of its own there, and Redis (``REDIS_URL``)
for its broker and channel layer.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.e2e.harness import WAIT, Deployment, assert_stored_matches
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

SERVER_URL = os.environ.get("DATABASE_URL", "")
ON_POSTGRES = SERVER_URL.startswith(("postgres://", "postgresql://"))


def _server(database: str) -> str:
    parts = urlsplit(SERVER_URL)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", "", ""))


@pytest.fixture
def deployment(tmp_path: Path) -> Any:
    settings: dict[str, str] = {}
    database = ""
    if ON_POSTGRES:
        import psycopg

        database = f"poison_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(_server("postgres"), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{database}"')
        settings["DATABASE_URL"] = _server(database)
        if os.environ.get("REDIS_URL"):
            settings["REDIS_URL"] = os.environ["REDIS_URL"]
    d = Deployment(tmp_path, **settings)
    yield d
    d.stop_all()
    print(d.logs())  # shown by pytest when the test failed
    if database:
        import psycopg

        with psycopg.connect(_server("postgres"), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def stored(d: Deployment, run_id: int) -> dict[int, tuple[str, int]]:
    """seq -> (kind, rows) for every row-backed event stored for the run, on either database."""
    if not ON_POSTGRES:
        return d.stored(run_id)
    import psycopg

    out: dict[int, tuple[str, int]] = {}
    with psycopg.connect(d.env["DATABASE_URL"]) as conn:
        for kind, table in (("metrics", "runs_metricpoint"), ("samples", "runs_sample"),
                            ("checkpoint", "runs_checkpoint"), ("log", "runs_logline")):  # fmt: skip
            for seq, rows in conn.execute(f"SELECT seq, COUNT(*) FROM {table} WHERE run_id = %s GROUP BY seq", (run_id,)):
                assert seq not in out, f"seq {seq} stored as {out[seq][0]} and {kind}"
                out[seq] = (kind, rows)
    return out


def query(d: Deployment, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` (written with ``?`` placeholders) from the deployment's database."""
    if ON_POSTGRES:
        import psycopg

        with psycopg.connect(d.env["DATABASE_URL"]) as conn:
            return list(conn.execute(sql.replace("?", "%s"), params))
    import sqlite3

    with sqlite3.connect(d.data / "tributary.sqlite3") as conn:
        return list(conn.execute(sql, params))


def launch(d: Deployment, project: int, config: dict[str, Any]) -> int:
    return d.api("POST", f"/projects/{project}/runs", {"config": config, "name": config["name"]})["id"]


def test_a_nul_in_a_dataset_answer_no_longer_stalls_the_run(
    deployment: Deployment, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The reproduction: a JSONL run whose every row's answer holds NUL, so every samples event
    carries it (extra.answer). The engine writes it storable, and the run completes."""
    d = deployment
    rows = tmp_path_factory.mktemp("dataset") / "rows.jsonl"  # outside the deployment's (confined) tree
    with rows.open("w") as fh:
        for a in range(1, 9):
            fh.write(json.dumps({"prompt": f"{a}+{a}=", "answer": f"{2 * a}\u0000"}) + "\n")
    ids = d.setup()
    d.start_web()
    d.start_worker()
    config = tiny_config(tiny_model_dir, total_steps=6, name="nul-answer")
    config["data"] = {"source": "jsonl", "path": str(rows), "eval_size": 0}
    config["reward"] = {"functions": [{"name": "exact_match"}]}
    run_id = launch(d, ids["project"], config)

    run = d.wait_status(run_id, "succeeded", "failed", "lost", timeout=WAIT * 2)
    assert run["status"] == "succeeded", (run["status_message"], d.logs())
    log = d.engine_log(run_id)
    assert run["last_seq"] == log[-1]["seq"]
    assert_stored_matches(stored(d, run_id), log, run["last_seq"])
    answers = [json.loads(extra)["answer"] if isinstance(extra, str) else extra["answer"]
               for (extra,) in query(d, "SELECT extra FROM runs_sample WHERE run_id = ?", run_id)]  # fmt: skip
    assert answers and all(a.endswith("\ufffd") and "\x00" not in a for a in answers)
    assert not query(d, "SELECT seq FROM runs_logline WHERE run_id = ? AND level = 'error'", run_id)


def _line(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"))


def test_poison_lines_are_stored_storable_or_quarantined_and_the_run_completes(deployment: Deployment, tmp_path: Path) -> None:
    """An event log as an older engine (or any other writer) could leave it, shipped by the
    worker's real shipper to the real web app: a NUL in a sample's answer and in a metric name,
    a lone surrogate in a log message, JSON nested deeper than the web app keeps and deeper than
    a parser can read, and a metric at a negative step. All of it is acked, the run completes,
    and every event is stored: storable, cut with a mark, or quarantined with its reason."""
    d = deployment
    ids = d.setup()
    d.start_web()
    config = tiny_config(Path("unused"), total_steps=1, name="poison-log")
    run_id = launch(d, ids["project"], config)  # no worker here: this test is the worker
    token = d.manage("shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))")
    token = token.strip().splitlines()[-1]

    r = str(run_id)
    sample = {"prompt": "2+2=", "completion": "4", "reward": 1.0, "advantage": 0.5, "length": 1,
              "finish_reason": "stop", "extra": {"answer": "4\u0000", "k\u0000": ["\u0000"]}}  # fmt: skip
    nested: Any = "leaf"
    for _ in range(40):
        nested = {"d": nested}
    lines = [
        _line({"run": r, "seq": 1, "type": "status", "state": "starting", "message": "loading"}),
        _line({"run": r, "seq": 2, "type": "status", "state": "running", "message": "step 0"}),
        _line({"run": r, "seq": 3, "type": "metrics", "step": 1, "time": 1.7e9, "values": {"reward\u0000/mean": 0.5, "loss": 1.0}}),
        _line({"run": r, "seq": 4, "type": "samples", "step": 1, "items": [sample, sample]}),
        # json.dumps writes a lone surrogate as the escape \ud800: valid JSON no encoder can store.
        _line({"run": r, "seq": 5, "type": "log", "level": "warning", "message": "lone \ud800 surrogate"}),
        _line({"run": r, "seq": 6, "type": "samples", "step": 1, "items": [{**sample, "extra": nested}]}),
        '{"run":"' + r + '","seq":7,"type":"log","level":"info","message":' + "[" * 50_000 + "]" * 50_000 + "}",
        _line({"run": r, "seq": 8, "type": "metrics", "step": -1, "time": 1.7e9, "values": {"loss": 2.0}}),
        _line({"run": r, "seq": 9, "type": "heartbeat", "time": 1.7e9}),
        _line({"run": r, "seq": 10, "type": "metrics", "step": 2, "time": 1.7e9, "values": {"loss": 0.5}}),
        _line({"run": r, "seq": 11, "type": "status", "state": "succeeded", "message": "finished 2 steps"}),
    ]  # fmt: skip
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")

    shipper = EventShipper(d.url, run_id, token, path, backoff_base=0.1, backoff_cap=1.0).start()
    assert shipper.finish(timeout=WAIT), d.logs()
    assert shipper.error is None and shipper.acked_seq == 11
    assert shipper.connections == 1, "a batch was refused and resent"
    assert shipper.quarantined == [8]

    run = d.run(run_id)
    assert (run["status"], run["last_seq"], run["last_step"]) == ("succeeded", 11, 2), d.logs()
    want = {3: ("metrics", 2), 4: ("samples", 2), 5: ("log", 1), 6: ("samples", 1), 7: ("log", 1), 8: ("log", 1),
            10: ("metrics", 1)}  # fmt: skip
    assert stored(d, run_id) == want
    logs = dict(((seq, (level, message)) for seq, level, message in
                 query(d, "SELECT seq, level, message FROM runs_logline WHERE run_id = ?", run_id)))  # fmt: skip
    assert logs[5] == ("warning", "lone \ufffd surrogate")
    assert logs[7][0] == "error" and "event 7" in logs[7][1] and "nested too deeply to parse" in logs[7][1]
    assert logs[8][0] == "error" and "event 8 (metrics) was quarantined" in logs[8][1] and "'step'" in logs[8][1]
    names = sorted(n for (n,) in query(d, "SELECT DISTINCT name FROM runs_metricpoint WHERE run_id = ?", run_id))
    assert names == ["loss", "reward\ufffd/mean"]
    extras = [e if isinstance(e, dict) else json.loads(e) for (e,) in
              query(d, "SELECT extra FROM runs_sample WHERE run_id = ? ORDER BY seq, id", run_id)]  # fmt: skip
    assert extras[0] == {"answer": "4\ufffd", "k\ufffd": ["\ufffd"]}
    assert "nested deeper than 32 levels: dropped" in json.dumps(extras[2])
