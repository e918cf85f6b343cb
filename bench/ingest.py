"""Ingest throughput and live latency through the whole product path, against psycopg COPY.

Throughput: an engine event log of ``--steps`` metrics events with ``--metrics`` values each
is shipped by the worker's real ``EventShipper`` over the ingest socket of a real uvicorn
serving ``webapp.asgi`` on PostgreSQL with the Redis channel layer (store, ack, broadcast
to the run's group with one subscriber). The reference writes the same rows into the same
table with psycopg ``COPY`` in one transaction (the physical floor for getting them into
PostgreSQL). Printed: points/s of each and the ratio (target >= 0.5).

Latency: ``--subscribers`` browser sockets follow one run through a share link; the engine
side emits ``--latency-events`` metrics events at 20 Hz into the log the shipper tails. For
every event and subscriber: receive time minus the event's own ``time`` (same clock).
Printed: p50, p99 and max.

    .venv/bin/python bench/ingest.py            # 2000 x 50 = 100k points, 50 subscribers
    .venv/bin/python bench/ingest.py --quick    # 300 x 50, 10 subscribers

Needs the machine's PostgreSQL and Redis (``DATABASE_URL``-style server URL and ``REDIS_URL``
below); it creates and drops its own database ``tributary_bench`` and uses Redis db 14.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
BENCH_DB = "tributary_bench"
REDIS_URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/14")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recreate_database() -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {BENCH_DB}")


def setup_django(env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def make_runs(n: int) -> list[Any]:
    from webapp.runs.models import Run
    from webapp.teams.models import Project, Team

    team = Team.objects.create(name="Bench", slug="bench")
    project = Project.objects.create(team=team, name="Ingest", slug="ingest")
    return [Run.objects.create(project=project, name=f"bench-{i}") for i in range(n)]


def start_web(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--port", str(port),
         "--lifespan", "on", "--log-level", "warning", "--ws-max-size", str(16 * 1024 * 1024)],
        cwd=ROOT, env={**os.environ, **env},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("uvicorn did not answer /health/ within 60 s")


def write_log(path: Path, run_id: int, steps: int, n_metrics: int) -> int:
    from engine.events import EventSink

    sink = EventSink(str(run_id), path)
    names = [f"bench/metric_{i:02d}" for i in range(n_metrics)]
    for step in range(1, steps + 1):
        sink.metrics(step, {name: step * 0.001 + i for i, name in enumerate(names)})
    sink.close()
    return steps * n_metrics


def ship(web_url: str, run_id: int, path: Path) -> float:
    from tributary.shipper import EventShipper
    from webapp.runs.tokens import ingest_token

    shipper = EventShipper(web_url, run_id, ingest_token(run_id), path)
    t0 = time.perf_counter()
    shipper.start()
    if not shipper.finish(timeout=900):
        raise SystemExit(f"shipping did not finish: {shipper.error or shipper.last_error_message}")
    return time.perf_counter() - t0


def copy_reference(run_id: int, steps: int, n_metrics: int) -> float:
    import psycopg

    names = [f"bench/metric_{i:02d}" for i in range(n_metrics)]
    now = datetime.now(UTC)
    rows = [
        (run_id, name, step, step * 0.001 + i, now, step)
        for step in range(1, steps + 1)
        for i, name in enumerate(names)
    ]
    t0 = time.perf_counter()
    with psycopg.connect(f"{PG_SERVER}/{BENCH_DB}") as conn:
        with conn.cursor() as cur, cur.copy(
            "COPY runs_metricpoint (run_id, name, step, value, time, seq) FROM STDIN"
        ) as copy:
            for row in rows:
                copy.write_row(row)
        conn.commit()
    return time.perf_counter() - t0


class Subscribers:
    """``n`` browser sockets on one run (share link), recording receive minus event time."""

    def __init__(self, url: str, origin: str, n: int) -> None:
        self.url, self.origin, self.n = url, origin, n
        self.latencies: list[float] = []
        self.received: list[int] = [0] * n
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._open_all(), self.loop).result(timeout=120)

    async def _open_all(self) -> None:
        from websockets.asyncio.client import connect

        self.sockets = []
        for _ in range(self.n):
            ws = await connect(self.url, origin=self.origin, max_size=None)
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello", hello
            self.sockets.append(ws)
        self.tasks = [self.loop.create_task(self._listen(i, ws)) for i, ws in enumerate(self.sockets)]

    async def _listen(self, index: int, ws: Any) -> None:
        async for raw in ws:
            now = time.time()
            message = json.loads(raw)
            if message.get("type") != "events":
                continue
            for event in message["events"]:
                if event["type"] == "metrics":
                    self.latencies.append(now - event["time"])
                    self.received[index] += 1

    def wait_for(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if min(self.received) >= count:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        async def close_all() -> None:
            for ws in self.sockets:
                await ws.close()

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def latency(web_url: str, port: int, run: Any, workdir: Path, n_subscribers: int, n_events: int) -> list[float]:
    from engine.events import EventSink
    from tributary.shipper import EventShipper
    from webapp.runs.models import ShareLink
    from webapp.runs.tokens import ingest_token

    link = ShareLink.create(run, None)
    subs = Subscribers(
        f"ws://127.0.0.1:{port}/ws/runs/{run.pk}/?share={link.token}", f"http://127.0.0.1:{port}", n_subscribers
    )
    subs.start()
    path = workdir / f"latency-{run.pk}.jsonl"
    sink = EventSink(str(run.pk), path)
    shipper = EventShipper(web_url, run.pk, ingest_token(run.pk), path).start()
    for step in range(1, n_events + 1):
        sink.metrics(step, {"bench/latency": float(step)})
        time.sleep(0.05)
    sink.close()
    ok = subs.wait_for(n_events, timeout=120)
    shipper.finish(timeout=60)
    subs.close()
    if not ok:
        raise SystemExit(f"subscribers got {min(subs.received)} of {n_events} events")
    return subs.latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--subscribers", type=int, default=50)
    parser.add_argument("--latency-events", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.subscribers, args.latency_events = 300, 10, 50

    workdir = Path(tempfile.mkdtemp(prefix="tributary-bench-"))
    env = {
        "DATABASE_URL": f"{PG_SERVER}/{BENCH_DB}",
        "REDIS_URL": REDIS_URL,
        "SECRET_KEY": secrets.token_urlsafe(40),
        "TRIBUTARY_DATA_DIR": str(workdir / "data"),
        "LOG_LEVEL": "WARNING",
    }
    recreate_database()
    setup_django(env)
    shipped_run, copied_run, copied_again, latency_run = make_runs(4)
    port = free_port()
    web_url = f"http://127.0.0.1:{port}"
    web = start_web(env, port)
    try:
        points = write_log(workdir / "events.jsonl", shipped_run.pk, args.steps, args.metrics)
        copy_s = copy_reference(copied_run.pk, args.steps, args.metrics)
        path_s = ship(web_url, shipped_run.pk, workdir / "events.jsonl")
        copy_s = (copy_s + copy_reference(copied_again.pk, args.steps, args.metrics)) / 2

        from webapp.runs.models import MetricPoint

        stored = MetricPoint.objects.filter(run=shipped_run).count()
        if stored != points:
            raise SystemExit(f"stored {stored} of {points} points")
        lat = latency(web_url, port, latency_run, workdir, args.subscribers, args.latency_events)
    finally:
        web.terminate()
        web.wait(timeout=30)

    print(f"ingest: {args.steps} metrics events x {args.metrics} values = {points:,} points")
    print(f"{'path':<52} {'seconds':>8} {'points/s':>12}")
    print(f"{'psycopg COPY (reference, mean of 2)':<52} {copy_s:8.2f} {points / copy_s:12,.0f}")
    print(f"{'worker -> WebSocket -> PostgreSQL -> broadcast':<52} {path_s:8.2f} {points / path_s:12,.0f}")
    print(f"ratio path/COPY: {copy_s / path_s:.2f} (target >= 0.50)")
    print(
        f"latency engine event -> {args.subscribers} browser sockets ({len(lat):,} deliveries): "
        f"p50 {percentile(lat, 0.5) * 1000:.1f} ms, p99 {percentile(lat, 0.99) * 1000:.1f} ms, "
        f"max {max(lat) * 1000:.1f} ms, mean {statistics.fmean(lat) * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
