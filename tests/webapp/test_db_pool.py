"""The web app's PostgreSQL connections are bounded by its pool (PostgreSQL pass only).

A real uvicorn serving ``webapp.asgi`` against a scratch database on the PostgreSQL server of
``DATABASE_URL``, hammered by many concurrent clients on the metric series and the runs list,
never holds more server connections than ``DATABASE_POOL_MAX`` (counted in
``pg_stat_activity`` by the web process's own ``application_name``), answers every request, and
lets idle connections go afterwards. A request that cannot get a connection within
``DATABASE_POOL_TIMEOUT`` is a 503 with ``Retry-After``, on the API and on a page, not a 500.

Time limits only keep a broken build from hanging; nothing asserts a duration.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.e2e.harness import Deployment, wait_until
from webapp.config import database_from_url, database_pool_from_env

SERVER_URL = os.environ.get("DATABASE_URL", "")

# --- the pool's settings -----------------------------------------------------------------


def test_the_pool_is_on_by_default_with_no_persistent_connections(monkeypatch, tmp_path) -> None:
    for name in ("DATABASE_POOL_MAX", "DATABASE_POOL_MIN", "DATABASE_POOL_TIMEOUT", "DATABASE_POOL_MAX_IDLE"):
        monkeypatch.delenv(name, raising=False)
    pool = database_pool_from_env()
    assert pool == {"min_size": 2, "max_size": 10, "timeout": 30.0, "max_idle": 60.0, "name": "tributary-web"}
    db = database_from_url("postgres://u@db/x?sslmode=require", tmp_path, pool=pool)
    assert db["OPTIONS"] == {"sslmode": "require", "pool": pool} and db["CONN_MAX_AGE"] == 0
    assert "pool" not in database_from_url("", tmp_path, pool=pool)["OPTIONS"]  # SQLite has none


def test_the_deployment_sizes_the_pool_or_turns_it_off(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DATABASE_POOL_MAX", "25")
    monkeypatch.setenv("DATABASE_POOL_MIN", "0")
    monkeypatch.setenv("DATABASE_POOL_TIMEOUT", "2.5")
    monkeypatch.setenv("DATABASE_POOL_MAX_IDLE", "30")
    assert database_pool_from_env() == {
        "min_size": 0, "max_size": 25, "timeout": 2.5, "max_idle": 30.0, "name": "tributary-web"
    }  # fmt: skip
    monkeypatch.setenv("DATABASE_POOL_MAX", "0")  # e.g. behind PgBouncer
    assert database_pool_from_env() is None
    db = database_from_url("postgres://u@db/x", tmp_path, pool=database_pool_from_env())
    assert "pool" not in db["OPTIONS"] and db["CONN_MAX_AGE"] == 0  # a connection per request, closed after
    monkeypatch.setenv("DATABASE_POOL_MAX", "1")
    monkeypatch.delenv("DATABASE_POOL_MIN")
    assert database_pool_from_env()["min_size"] == 1  # the default minimum never exceeds the maximum


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DATABASE_POOL_MAX": "ten"}, "DATABASE_POOL_MAX='ten' is not an integer"),
        ({"DATABASE_POOL_MAX": "-1"}, "DATABASE_POOL_MAX=-1 is too small: use at least 0"),
        (
            {"DATABASE_POOL_MAX": "4", "DATABASE_POOL_MIN": "5"},
            "DATABASE_POOL_MIN=5 is larger than DATABASE_POOL_MAX=4",
        ),
        ({"DATABASE_POOL_TIMEOUT": "soon"}, "DATABASE_POOL_TIMEOUT='soon' is not a number"),
        ({"DATABASE_POOL_TIMEOUT": "0"}, "DATABASE_POOL_TIMEOUT=0 is too small: use at least 0.1"),
        ({"DATABASE_POOL_TIMEOUT": "nan"}, "DATABASE_POOL_TIMEOUT='nan' is not a finite number"),
        ({"DATABASE_POOL_MAX_IDLE": "0.5"}, "DATABASE_POOL_MAX_IDLE=0.5 is too small: use at least 1"),
    ],
)
def test_bad_pool_settings_are_refused_with_the_variable_named(monkeypatch, env, message) -> None:
    from django.core.exceptions import ImproperlyConfigured

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        database_pool_from_env()


# --- a real server under load ---------------------------------------------------------------

POOL_MAX = 4
CLIENTS = 48
REQUESTS_EACH = 12


def server_url(database: str, **query: str) -> str:
    parts = urlsplit(SERVER_URL)
    return urlunsplit(
        (parts.scheme, parts.netloc, f"/{database}", "&".join(f"{k}={v}" for k, v in query.items()), "")
    )


def admin_connect() -> Any:
    import psycopg

    return psycopg.connect(server_url("postgres"), autocommit=True)


def held(database: str, application: str, *, waiting_on_lock: bool = False, conn: Any = None) -> int:
    """Server connections the web process holds (its own application_name, its database)."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
    if waiting_on_lock:
        sql += " AND wait_event_type = 'Lock'"
    if conn is not None:
        return conn.execute(sql, (database, application)).fetchone()[0]
    with admin_connect() as own:
        return own.execute(sql, (database, application)).fetchone()[0]


@pytest.fixture(scope="module")
def scratch_database() -> Iterator[str]:
    name = f"tributary_pooltest_{uuid.uuid4().hex[:10]}"
    with admin_connect() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with admin_connect() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def deployment(root: Path, database: str, application: str, **pool: str) -> Deployment:
    return Deployment(root, DATABASE_URL=server_url(database, application_name=application), **pool)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, scratch_database: str) -> Iterator[dict[str, Any]]:
    """The scratch database migrated, with a user, a token, a project and a run of 3 x 400 points."""
    d = deployment(tmp_path_factory.mktemp("pool-setup"), scratch_database, "tributary-pooltest-setup")
    ids = d.setup()
    out = d.manage(
        "shell",
        "-c",
        "from django.utils import timezone\n"
        "from webapp.runs.models import MetricPoint, Run, ShareLink\n"
        f"run = Run.objects.create(project_id={ids['project']}, name='pooled')\n"
        "now = timezone.now()\n"
        "MetricPoint.objects.bulk_create(MetricPoint(run=run, name=n, step=s, value=s * 0.5, time=now, seq=s)\n"
        "    for n in ('reward/mean', 'actor/entropy', 'response_length/mean') for s in range(1, 401))\n"
        "print(run.pk, ShareLink.create(run, None).token)\n",
    )
    run, share = out.split()[-2:]
    yield {
        "database": scratch_database, "token": d.api_token, "project": ids["project"], "run": int(run), "share": share
    }  # fmt: skip


def get(url: str, token: str, timeout: float = 120) -> tuple[int, Any, bytes]:
    """Status, headers (case-insensitive ``get``) and body."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.mark.postgresql  # the connection pool is PostgreSQL's
def test_many_concurrent_clients_never_exceed_the_pool(tmp_path: Path, site: dict[str, Any]) -> None:
    application = f"tributary-pooltest-{uuid.uuid4().hex[:8]}"
    web = deployment(
        tmp_path, site["database"], application,
        DATABASE_POOL_MAX=str(POOL_MAX), DATABASE_POOL_MIN="1", DATABASE_POOL_TIMEOUT="120",
        DATABASE_POOL_MAX_IDLE="1", API_TOKEN_FAILURE_LIMIT="0",
    )  # fmt: skip
    web.start_web()
    try:
        paths = [
            f"/api/runs/{site['run']}/metrics/series?max_points=100",
            f"/api/projects/{site['project']}/runs?limit=20",
        ]
        statuses: list[int] = []
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            with admin_connect() as monitor:
                while not done.is_set():
                    peak[0] = max(peak[0], held(site["database"], application, conn=monitor))
                    time.sleep(0.02)

        def client(index: int) -> None:
            for i in range(REQUESTS_EACH):
                status, _, body = get(web.url + paths[(index + i) % 2], site["token"])
                if status == 200:
                    json.loads(body)
                statuses.append(status)

        # Browsers following the run over its socket (share link): the consumers read the
        # database through database_sync_to_async, which must hand connections back too.
        from websockets.sync.client import connect

        sockets = contextlib.ExitStack()
        for _ in range(5):
            ws = sockets.enter_context(
                connect(f"ws://127.0.0.1:{web.port}/ws/runs/{site['run']}/?share={site['share']}",
                        origin=web.url, open_timeout=60, max_size=None)
            )  # fmt: skip
            assert json.loads(ws.recv(timeout=60))["type"] == "hello"
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        clients = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=600)
        done.set()
        sampler.join(timeout=30)

        errors = [s for s in statuses if s != 200]
        assert len(statuses) == CLIENTS * REQUESTS_EACH and not errors, (errors[:20], web.logs())
        assert 2 <= peak[0] <= POOL_MAX, f"peak {peak[0]} server connections with a pool of {POOL_MAX}"
        assert held(site["database"], application) <= POOL_MAX
        # Idle connections above DATABASE_POOL_MIN are closed (one per DATABASE_POOL_MAX_IDLE s),
        # while the browsers' sockets stay open: none of them holds a connection.
        wait_until(lambda: held(site["database"], application) <= 1, "idle pooled connections to close", 120)
        sockets.close()
    finally:
        web.stop_all()


@pytest.mark.postgresql  # the connection pool is PostgreSQL's
def test_a_request_that_gets_no_connection_in_time_is_a_503(tmp_path: Path, site: dict[str, Any]) -> None:
    import psycopg

    application = f"tributary-pooltest-{uuid.uuid4().hex[:8]}"
    web = deployment(
        tmp_path, site["database"], application,
        DATABASE_POOL_MAX="1", DATABASE_POOL_MIN="1", DATABASE_POOL_TIMEOUT="1",
    )  # fmt: skip
    web.start_web()
    blocked: list[tuple[int, Any, bytes]] = []
    try:
        # Hold a lock the token check needs: the next API request takes the pool's only
        # connection and waits on the lock with it.
        with psycopg.connect(server_url(site["database"])) as locker:
            locker.execute("LOCK TABLE api_apitoken IN ACCESS EXCLUSIVE MODE")
            first = threading.Thread(target=lambda: blocked.append(get(f"{web.url}/api/me", site["token"])))
            first.start()
            wait_until(
                lambda: held(site["database"], application, waiting_on_lock=True) == 1,
                "the web process's one connection to wait on the lock",
                120,
            )
            status, headers, body = get(f"{web.url}/api/runs/{site['run']}", site["token"])
            assert status == 503, (status, body[:500])
            assert "no database connection became free in time" in json.loads(body)["detail"]
            assert int(headers.get("Retry-After")) > 0
            status, headers, body = get(f"{web.url}/health/", "")  # a page, not the API
            assert status == 503 and b"no database connection became free in time" in body, (
                status,
                body[:500],
            )
            assert "Traceback" not in body.decode()
            locker.rollback()
        first.join(timeout=120)
        assert blocked and blocked[0][0] == 200, blocked  # the waiting request went through
        assert get(f"{web.url}/api/runs/{site['run']}", site["token"])[0] == 200
        assert "Traceback" not in web.logs()
    finally:
        web.stop_all()
