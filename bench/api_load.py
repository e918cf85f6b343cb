"""API under load: many concurrent clients on the metric series and the runs list, the web app with
its PostgreSQL connection pool against the old configuration (no pool, ``CONN_MAX_AGE=60``).

One uvicorn process serves ``webapp.asgi`` as the Docker image does. ``--clients`` concurrent
clients (aiohttp, one keep-alive connection each) loop for ``--duration`` seconds, alternating
``GET /api/runs/<id>/metrics/series`` (``--series-metrics`` of a run's ``--metrics`` metrics of
``--steps`` steps each, downsampled in the database to 1000 points per series, as a chart asks) and ``GET /api/projects/<id>/runs`` (a page of 50 of
the project's runs), with a personal API token. Printed per configuration: requests, requests/s,
p50/p99 latency, errors (anything but a 200, and failed connections), the peak of server
connections the web process held (``pg_stat_activity`` by its ``application_name``, sampled
every 50 ms) against the pool size, and what it still held 5 s after the load stopped. Then the
pooled figures as ratios of the reference, measured in the same run on the same data.

    .venv/bin/python bench/api_load.py              # 200 clients, 60 s per configuration
    .venv/bin/python bench/api_load.py --quick      # 200 clients, 15 s per configuration

By default it starts a PostgreSQL server of its own (``initdb`` in a temporary directory, the
stock ``max_connections=100``, dropped at the end): the reference configuration is expected to
exhaust the server's connections, which must not happen to a server other things use.
``--pg postgres://user@host:port`` uses an existing server instead (a scratch database is
created and dropped). Needs the ``bench`` extra for aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH_DB = "tributary_apiload"
REFERENCE_SETTINGS = """\
# The configuration before the pool: persistent connections, one per request thread.
from webapp.settings import *  # noqa: F403

DATABASES["default"]["OPTIONS"].pop("pool", None)  # noqa: F405
DATABASES["default"]["CONN_MAX_AGE"] = 60  # noqa: F405
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    if not found:
        raise SystemExit(
            f"{name} not found: install PostgreSQL's server (apt-get install postgresql) or pass --pg URL"
        )
    return str(found)


@contextmanager
def private_postgres(workdir: Path) -> Any:
    """A throwaway PostgreSQL server on a free port (as the postgres user when run as root)."""
    data, port = workdir / "pgdata", free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root
        shutil.chown(workdir, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    run = lambda *argv: subprocess.run([*as_user, *argv], check=True, capture_output=True, text=True)  # noqa: E731
    run(_pg_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    options = f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={workdir} -c max_connections=100"
    run(_pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(workdir / "postgres.log"), "-w", "start")
    try:
        yield f"postgres://postgres@127.0.0.1:{port}"
    finally:
        run(_pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(data, ignore_errors=True)  # the web logs stay beside it


def recreate_database(server: str) -> None:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {BENCH_DB}")


def drop_database(server: str) -> None:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")


def prepare(server: str, env: dict[str, str], steps: int, n_metrics: int, n_runs: int) -> dict[str, Any]:
    """Migrate; a user with a token, a project of ``n_runs`` runs, one with the metric points."""
    import psycopg

    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connections

    from webapp.api.models import ApiToken
    from webapp.runs.models import Run
    from webapp.teams.models import Project
    from webapp.teams.services import create_team

    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_user("bench")
    project = Project.objects.create(team=create_team("Bench", user), name="Load", slug="load")
    runs = [Run.objects.create(project=project, name=f"run-{i:03d}", created_by=user) for i in range(n_runs)]
    token = ApiToken.issue(user, "bench")[1]
    names = [f"bench/metric_{i:02d}" for i in range(n_metrics)]
    now = datetime.now(UTC)
    with psycopg.connect(f"{server}/{BENCH_DB}") as conn:
        with (
            conn.cursor() as cur,
            cur.copy("COPY runs_metricpoint (run_id, name, step, value, time, seq) FROM STDIN") as copy,
        ):
            for step in range(1, steps + 1):
                for i, name in enumerate(names):
                    copy.write_row((runs[0].pk, name, step, step * 0.001 + i, now, step))
        conn.execute("ANALYZE")
        conn.commit()
    for conn in connections.all(initialized_only=True):
        conn.close()
        if getattr(conn, "pool", None) is not None:
            conn.close_pool()
    return {"token": token, "run": runs[0].pk, "project": project.pk, "points": steps * n_metrics}


def start_web(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--port", str(port),
         "--lifespan", "on", "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"uvicorn exited: {log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("uvicorn did not answer /health/ within 120 s")


class ConnectionSampler:
    """Peak of the server connections one application holds, sampled every 50 ms."""

    def __init__(self, server: str, application: str) -> None:
        self.server, self.application = server, application
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def count(self) -> int:
        import psycopg

        with psycopg.connect(f"{self.server}/postgres", autocommit=True) as conn:
            return self._count(conn)

    def _count(self, conn: Any) -> int:
        sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s"
        return conn.execute(sql, (BENCH_DB, self.application)).fetchone()[0]

    def _main(self) -> None:
        import psycopg

        with psycopg.connect(f"{self.server}/postgres", autocommit=True) as conn:
            while not self._stop.is_set():
                self.peak = max(self.peak, self._count(conn))
                time.sleep(0.05)

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


async def load(base: str, token: str, paths: list[str], clients: int, duration: float) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    errors: dict[str, int] = {}
    stop_at = time.monotonic() + duration

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        i = index
        while time.monotonic() < stop_at:
            path = paths[i % len(paths)]
            i += 1
            t0 = time.perf_counter()
            try:
                async with session.get(base + path) as response:
                    await response.read()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.1)
                continue
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1

    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, session) for i in range(clients)))
        elapsed = time.perf_counter() - t0
    return {"latencies": latencies, "errors": errors, "elapsed": elapsed}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    label: str,
    env: dict[str, str],
    server: str,
    data: dict[str, Any],
    args: argparse.Namespace,
    workdir: Path,
) -> dict[str, Any]:
    application = f"tributary-apiload-{label}"
    env = {**env, "DATABASE_URL": f"{server}/{BENCH_DB}?application_name={application}"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    web = start_web(env, port, workdir / f"web-{label}.log")
    names = ",".join(f"bench/metric_{i:02d}" for i in range(min(args.series_metrics, args.metrics)))
    paths = [
        f"/api/runs/{data['run']}/metrics/series?max_points=1000&names={names}",
        f"/api/projects/{data['project']}/runs?limit=50",
    ]
    try:
        asyncio.run(load(base, data["token"], paths, min(args.clients, 20), 2.0))  # warm-up
        sampler = ConnectionSampler(server, application)
        with sampler:
            result = asyncio.run(load(base, data["token"], paths, args.clients, args.duration))
        time.sleep(5)
        result["held_after"] = sampler.count()
        result["peak"] = sampler.peak
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        web.wait(timeout=60)
    lat = result["latencies"]
    result["requests"] = len(lat) + sum(result["errors"].values())
    result["rps"] = len(lat) / result["elapsed"]
    result["p50"], result["p99"] = percentile(lat, 0.5) * 1000, percentile(lat, 0.99) * 1000
    result["mean"] = statistics.fmean(lat) * 1000 if lat else float("nan")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per configuration")
    parser.add_argument("--pool-max", type=int, default=10, help="DATABASE_POOL_MAX of the pooled run")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--metrics", type=int, default=20)
    parser.add_argument("--series-metrics", type=int, default=4, help="metrics per series request")
    parser.add_argument("--runs", type=int, default=120, help="runs in the listed project")
    parser.add_argument("--pg", default="", help="an existing PostgreSQL server URL (default: a private one)")
    parser.add_argument("--no-reference", action="store_true", help="measure the pooled configuration only")
    parser.add_argument("--quick", action="store_true", help="15 s per configuration")
    args = parser.parse_args()
    if args.quick:
        args.duration = 15.0

    workdir = Path(tempfile.mkdtemp(prefix="tributary-apiload-"))
    workdir.chmod(0o755)  # the private server's own user must reach its directory
    (workdir / "modules").mkdir()
    (workdir / "modules" / "apiload_reference_settings.py").write_text(REFERENCE_SETTINGS)
    base_env = {
        **os.environ,
        "SECRET_KEY": secrets.token_urlsafe(40),
        "TRIBUTARY_DATA_DIR": str(workdir / "data"),
        "LOG_LEVEL": "WARNING",
    }
    for name in ("REDIS_URL", "DJANGO_SETTINGS_MODULE"):
        base_env.pop(name, None)
    with private_postgres(workdir / "pg") if not args.pg else _existing(args.pg) as server:
        recreate_database(server)
        try:
            data = prepare(
                server,
                {**base_env, "DATABASE_URL": f"{server}/{BENCH_DB}"},
                args.steps,
                args.metrics,
                args.runs,
            )
            pooled_env = {**base_env, "DATABASE_POOL_MAX": str(args.pool_max)}
            results = {"pool": measure("pool", pooled_env, server, data, args, workdir)}
            if not args.no_reference:
                reference_env = {
                    **base_env,
                    "DJANGO_SETTINGS_MODULE": "apiload_reference_settings",
                    "PYTHONPATH": os.pathsep.join([str(workdir / "modules"), str(ROOT)]),
                }
                results["reference"] = measure("reference", reference_env, server, data, args, workdir)
        finally:
            drop_database(server)

    load1, load5, _ = os.getloadavg()
    print(
        f"api load: {args.clients} clients x {args.duration:.0f} s; series of {args.series_metrics} metrics from a run "
        f"of {data['points']:,} points ({args.metrics} metrics x {args.steps} steps), and a page of 50 of a project's "
        f"{args.runs} runs; one uvicorn process; machine load average {load1:.1f} (1 min), {load5:.1f} (5 min)"
    )
    header = f"{'configuration':<40} {'requests':>9} {'ok req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'peak conns':>11} {'held after':>11}"
    print(header)
    rows = [
        ("pool", f"pool (DATABASE_POOL_MAX={args.pool_max})"),
        ("reference", "reference: no pool, CONN_MAX_AGE=60"),
    ]
    for key, label in rows:
        if key not in results:
            continue
        r = results[key]
        errors = sum(r["errors"].values())
        peak = f"{r['peak']}/{args.pool_max}" if key == "pool" else str(r["peak"])
        print(
            f"{label:<40} {r['requests']:>9,} {r['rps']:>8.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} {errors:>7} "
            f"{peak:>11} {r['held_after']:>11}"
        )
        if r["errors"]:
            print(f"{'':<40} errors by kind: {r['errors']}")
    if "reference" in results:
        p, r = results["pool"], results["reference"]
        print(
            f"pool / reference: req/s {p['rps'] / r['rps']:.2f}x, p50 {p['p50'] / r['p50']:.2f}x, "
            f"p99 {p['p99'] / r['p99']:.2f}x, errors {sum(p['errors'].values())} vs {sum(r['errors'].values())}, "
            f"peak connections {p['peak']} vs {r['peak']}"
        )
    target = (
        "met"
        if sum(results["pool"]["errors"].values()) == 0 and results["pool"]["peak"] <= args.pool_max
        else "MISSED"
    )
    print(f"target (0 errors, never more connections than the pool): {target}")


@contextmanager
def _existing(url: str) -> Any:
    yield url.rstrip("/")


if __name__ == "__main__":
    main()
