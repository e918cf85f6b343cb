"""The metrics CSV export streams under ASGI: through a real uvicorn server, a large export
arrives complete and exact while the server's memory stays bounded, and a client that goes
away mid-body leaves the server healthy (issue 13, item 5).

The server is ``tests.e2e.harness.Deployment`` (uvicorn serving ``webapp.asgi``) on its own
database: a SQLite file in its data directory, or, in the PostgreSQL pass (``DATABASE_URL``
set), a database of its own on that server, created and dropped here.

Memory: ``VmHWM`` in ``/proc/<pid>/status`` is the server process's peak resident set. A body
Django buffers whole holds every row's text at once (about 2x the CSV's size as Python
strings); a streamed one holds a couple of ``CSV_CHUNK_ROWS``-row pieces (well under a MB)
plus allocator slack. The bound below sits between the two, and the export is made big
enough that a buffered body could not stay under it.
"""

from __future__ import annotations

import csv
import io
import os
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.e2e.harness import Deployment, wait_until
from webapp.runs.selectors import CSV_CHUNK_ROWS

pytestmark = pytest.mark.slow

NAMES = [f"metric/{i:02d}" for i in range(20)]
STEPS = 20_000  # x 20 names = 400,000 rows, about 24 MB of long-format CSV
T0 = "2026-01-01T00:00:00+00:00"
BOUND_MB = 10.0
"""Peak growth allowed for the big export: a couple of pieces of CSV_CHUNK_ROWS rows (text and
the database rows behind it, < 1 MB each) with generous slack for the allocator and the
connection's buffers; a buffered 24 MB body needs several times this."""

POPULATE = """
import datetime
from django.db import connection, transaction
from webapp.runs.models import MetricPoint, Run
from webapp.teams.models import Project
names, steps = {names!r}, {steps}
t0 = datetime.datetime.fromisoformat({t0!r})
run = Run.objects.create(project=Project.objects.get(pk={project}), name="big export", config={{}})
# The database makes the rows (every step with every name) from one statement: bulk_create's
# 400,000 model instances and parameters took most of this module's time (minutes on
# PostgreSQL). value = (step * 1000 + j) / 7 in double precision, as Python divides; time =
# t0 + step seconds, stored as the ORM stores it. The export test compares every row it
# receives with _expected_long, so a row made wrong here fails it.
field, quote = MetricPoint._meta.get_field, connection.ops.quote_name
columns = ", ".join(quote(field(f).column) for f in ("run", "name", "step", "value", "time", "seq", "attempt", "superseded"))
if connection.vendor == "postgresql":
    time = "CAST(%s AS timestamptz) + s.step * interval '1 second'"
else:
    time = "datetime(%s, '+' || s.step || ' seconds')"
sql = (
    "WITH RECURSIVE s(step) AS (SELECT 0 UNION ALL SELECT step + 1 FROM s WHERE step + 1 < %s), "
    "n(j, name) AS (VALUES " + ", ".join(["(%s, %s)"] * len(names)) + ") "
    f"INSERT INTO {{quote(MetricPoint._meta.db_table)}} ({{columns}}) "
    f"SELECT %s, n.name, s.step, CAST(s.step * 1000 + n.j AS DOUBLE PRECISION) / 7, {{time}}, s.step + 1, 1, %s "
    "FROM s CROSS JOIN n"
)
params = [steps, *[v for pair in enumerate(names) for v in pair], run.pk, connection.ops.adapt_datetimefield_value(t0), False]
with transaction.atomic(), connection.cursor() as cursor:
    cursor.execute(sql, params)
print(run.pk)
"""


def _expected_long(names: list[str], steps: int) -> Iterator[list[str]]:
    from datetime import datetime, timedelta

    t0 = datetime.fromisoformat(T0)
    yield ["step", "name", "value", "time"]
    for j, name in sorted(enumerate(names), key=lambda item: item[1]):
        for step in range(steps):
            yield [str(step), name, repr((step * 1000 + j) / 7), (t0 + timedelta(seconds=step)).isoformat()]


def _own_database_url() -> str | None:
    """In the PostgreSQL pass: a fresh database for the server beside the test database."""
    url = os.environ.get("DATABASE_URL")
    if not url:
        return None
    import psycopg

    parts = urlsplit(url)
    # One per xdist worker, as pytest-django's test databases are (test_postgres_gw0, ...).
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    name = f"test_{parts.path.lstrip('/') or 'postgres'}_csv{'_' + worker if worker else ''}"
    admin = urlunsplit(parts._replace(path="/postgres", scheme="postgresql"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return urlunsplit(parts._replace(path=f"/{name}"))


def _drop_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres", scheme="postgresql"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Deployment, int]]:
    db_url = _own_database_url()
    deployment = Deployment(tmp_path_factory.mktemp("csv"), **({"DATABASE_URL": db_url} if db_url else {}))
    try:
        ids = deployment.setup()
        out = deployment.manage(
            "shell", "-c", POPULATE.format(names=NAMES, steps=STEPS, t0=T0, project=ids["project"])
        )
        run_id = int(out.strip().splitlines()[-1])
        deployment.start_web()
        yield deployment, run_id
    finally:
        deployment.stop_all()
        if db_url:
            _drop_database(db_url)


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _get(deployment: Deployment, path: str) -> urllib.request.addinfourl:
    request = urllib.request.Request(
        f"{deployment.url}{path}", headers={"Authorization": f"Bearer {deployment.api_token}"}
    )
    return urllib.request.urlopen(request, timeout=120)


def test_a_large_export_arrives_complete_with_bounded_server_memory(server: tuple[Deployment, int]) -> None:
    deployment, run_id = server
    assert deployment.web is not None
    pid = deployment.web.pid
    # Warm up every code path (imports, the connection, the first pieces) on a small export.
    with _get(deployment, f"/api/runs/{run_id}/metrics.csv?format=long&names=metric/00") as response:
        assert len(list(csv.reader(io.TextIOWrapper(response, encoding="utf-8")))) == STEPS + 1
    before = _peak_rss_mb(pid)

    received = 0
    rows = 0
    with _get(deployment, f"/api/runs/{run_id}/metrics.csv?format=long") as response:
        assert response.headers["Content-Type"].startswith("text/csv")
        counting = _Counting(response)
        reader = csv.reader(io.TextIOWrapper(counting, encoding="utf-8", newline=""))
        for got, want in zip(reader, _expected_long(NAMES, STEPS), strict=True):
            assert got == want, f"row {rows}: {got} != {want}"
            rows += 1
        received = counting.bytes
    growth = _peak_rss_mb(pid) - before
    print(f"export: {rows} rows, {received / 2**20:.1f} MB; server peak RSS {before:.0f} MB -> +{growth:.1f} MB")
    assert rows == len(NAMES) * STEPS + 1
    assert received / 2**20 > BOUND_MB, "the export must be bigger than the bound for the test to mean anything"
    assert growth < BOUND_MB, (
        f"the server's peak RSS grew by {growth:.1f} MB during a {received / 2**20:.1f} MB export: "
        f"more than {BOUND_MB} MB, so the body was not streamed in {CSV_CHUNK_ROWS}-row pieces"
    )


class _Counting(io.RawIOBase):
    def __init__(self, response: Any) -> None:
        self.response, self.bytes = response, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.response.read(len(buffer))
        buffer[: len(data)] = data
        self.bytes += len(data)
        return len(data)


def _open_cursors(deployment: Deployment) -> list[str]:
    """Statements of the server's PostgreSQL sessions that still sit on a server-side cursor."""
    import psycopg

    url = deployment.env["DATABASE_URL"]
    with psycopg.connect(url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND (query ILIKE 'FETCH%%' OR query ILIKE 'DECLARE%%')"
        ).fetchall()
    return [r[0] for r in rows]


def test_a_client_that_disconnects_mid_body_leaves_the_server_healthy(server: tuple[Deployment, int]) -> None:
    deployment, run_id = server
    log = deployment.root / "web.log"
    log_before = log.read_text(errors="replace") if log.exists() else ""
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", deployment.port), timeout=60) as sock:
            sock.sendall(
                f"GET /api/runs/{run_id}/metrics.csv?format=long HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {deployment.api_token}\r\n\r\n".encode()
            )
            got = b""
            while len(got) < 512 * 1024:  # a few pieces in, far from the end
                data = sock.recv(65536)
                assert data, "the server closed the connection early"
                got += data
            assert got.startswith(b"HTTP/1.1 200")
            # An abrupt close (RST), as a killed client or a dropped network would leave it.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # The server goes on: health, and a whole (smaller) export.
    with urllib.request.urlopen(f"{deployment.url}/health/", timeout=60) as response:
        assert response.status == 200
    with _get(deployment, f"/api/runs/{run_id}/metrics.csv?format=wide&names=metric/03") as response:
        rows = list(csv.reader(io.TextIOWrapper(response, encoding="utf-8")))
    assert len(rows) == STEPS + 1 and rows[0] == ["step", "metric/03"]
    assert rows[-1] == [str(STEPS - 1), repr(((STEPS - 1) * 1000 + 3) / 7)]
    if "DATABASE_URL" in deployment.env:
        # Each aborted export closed its cursor (a leaked one would leave its session on FETCH).
        wait_until(lambda: not _open_cursors(deployment), "the aborted exports' cursors to close", timeout=60)
    time.sleep(0.5)  # let the server finish writing its log
    new_log = log.read_text(errors="replace")[len(log_before) :]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log[-3000:]


@pytest.mark.parametrize(
    "path",
    [
        "/api/shared/a%00b/metrics.csv",
        "/share/a%00b/",
        "/api/runs/{run}/metrics.csv?names=a%00b",
        "/api/runs/{run}/metrics.csv?names=%FF%FE",
        "/api/runs/{run}/metrics.csv?names=%ED%A0%80",
        "/api/runs/%C2%B2/metrics.csv",
        "/api/runs/{run}/samples?offset=99999999999999999999",
        "/api/runs/{run}/samples?step=%C2%B2",
        "/compare/?runs=%C2%B2,99999999999999999999",
    ],
)
def test_malformed_input_through_uvicorn_is_a_4xx(server: tuple[Deployment, int], path: str) -> None:
    """The same inputs as ``test_malformed_input``, decoded by uvicorn and Django's ASGI handler
    instead of the test client: a 4xx (or a page), never a 5xx."""
    deployment, run_id = server
    request = urllib.request.Request(
        f"{deployment.url}{path.format(run=run_id)}", headers={"Authorization": f"Bearer {deployment.api_token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status < 500, f"{path}: {status}"
    if "%00" in path or "%FF" in path or "%ED" in path:
        assert status == 400, f"{path}: {status}"
