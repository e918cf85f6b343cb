"""Ingest throughput and live latency through the whole product path, against psycopg COPY.

Throughput: an engine event log of ``--steps`` metrics events with ``--metrics`` values each
is shipped by the worker's real ``EventShipper`` (two batches out while the log holds a
backlog; ``--window 1``: the stop-and-wait of before) over the ingest socket of a real uvicorn
serving ``webapp.asgi`` on PostgreSQL with the Redis channel layer (store, ack, broadcast
to the run's group with one subscriber). The reference writes the same rows into the same
table with psycopg ``COPY`` in one transaction (the physical floor for getting them into
PostgreSQL). ``--rounds N`` (3; 2 with ``--quick``) rounds, each a fresh log shipped into a fresh
run and the same rows copied into another, alternating which goes first (odd rounds COPY, even
rounds the path) so that a slow period of the shared machine falls on both, after ``--warmup``
(1) such rounds that are printed and not counted (the web app's first batches pay its warm-up,
which the worst round would otherwise report). Printed per round:
seconds of each, the ratio COPY s / path s, and CPU time (utime + stime from /proc), the least
load-dependent figure: the web app's process and its PostgreSQL backends while shipping (those of
``pg_stat_activity`` on the bench database whose client port is one of the web app's sockets,
sampled every 0.2 s: one that appears counts all its CPU, one that goes up to its last sample),
COPY's client (the bench thread, connect to commit) and its backend (``pg_backend_pid``), the
CPU ratio (COPY client + backend) / (web app + its backends): what the path costs the machine
against the floor, and the shipper's CPU (the bench process, not in the ratio). Then the median
ratio and the worst round's (target >= 0.9 on both, issue 19; 0.5 before), the median CPU
figures, the cores busy on average (CPU / wall: ~1 is a serial pipeline) and the web app's
backends (how many; appeared or went inside a round). Every round's stored point count is checked.

After the rounds, one round's events stored again in this process, batch by batch as the ingest socket
stores them (``ingest.prepare`` untimed, as in the socket's reading thread, then ``store_validated``), and
that time split into the points' COPY, the rollups, the summaries, the alert rules, the commits and the
rest (``STORE_PARTS``): what the product adds to COPY, part by part, without the socket and the shipper.

Latency: ``--subscribers`` browser sockets follow one run through a share link; the engine
side emits ``--latency-events`` metrics events at 20 Hz into the log the shipper tails. For
every event and subscriber: receive time minus the event's own ``time`` (same clock). After the
throughput part it starts once what that part wrote is on disk (``settle_writes``).
Printed: p50, p99 and max, and the same per hop, each timed from outside the product:

- write -> shipper send: the event's ``time`` to the shipper's read of the batch holding it
  (the bench wraps the shipper's ``EventLog.read``; the send follows at once);
- send -> group send: to when a listener the bench adds to the run's channel-layer group
  receives the ``run.events`` message (the web app received, stored, committed, announced);
- send -> ack: to when the shipper holds the ack (what a batch waits for when the shipper's
  window is full: ``--window`` batches out, 3 by default, 1 the stop-and-wait of before);
- group send -> browser: the group message to each browser socket's receive (the run consumer);
- waited for an ack: events written while the batch before theirs was out, their batch sent
  after its ack (their share, and the wait): what the flow control costs the live path (a
  trickle is stop-and-wait, ``client/tributary/shipper.py``).

The shipper thread's CPU time (``/proc/self/task/<tid>/stat``) and its empty reads of the log
say what the poll costs. ``--poll`` picks how the shipper learns that the log grew: ``fixed``
(every 50 ms, as before issue 19), ``adaptive`` (the default: 5 ms while events flow, slowing to
50 ms) or ``wake`` (the writer in this process calls ``EventShipper.wake``, as ``tributary.Run``
does). ``--ab N`` alternates ``--ab-modes`` N times on one web app (the same load) and prints
the median and range of each mode's p50 and p99.

    .venv/bin/python bench/ingest.py            # 2000 x 50 = 100k points, 50 subscribers
    .venv/bin/python bench/ingest.py --quick    # 300 x 50, 2 rounds, 10 subscribers
    .venv/bin/python bench/ingest.py --rounds 5 # 5 alternated throughput rounds
    .venv/bin/python bench/ingest.py --latency-only --ab 3   # fixed vs adaptive poll, 3 rounds
    .venv/bin/python bench/ingest.py --window 1              # the stop-and-wait shipper of before

Needs the machine's PostgreSQL and Redis (``DATABASE_URL``-style server URL and ``REDIS_URL``
below); it creates and drops its own database (``BENCH_DB``, default ``tributary_bench``) and uses Redis db 14.
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
BENCH_DB = os.environ.get("BENCH_DB", "tributary_bench")
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
    from webapp.runs.choices import RunStatus
    from webapp.runs.models import Run
    from webapp.teams.models import Project, Team

    team = Team.objects.create(name="Bench", slug="bench")
    project = Project.objects.create(team=team, name="Ingest", slug="ingest")
    # Running, as a run whose worker ships its events is: a queued one has no queue message
    # here, and the web app's reconciler would send it one (to a queue no worker reads).
    return [
        Run.objects.create(project=project, name=f"bench-{i}", status=RunStatus.RUNNING) for i in range(n)
    ]


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


def step_values(step: int, n_metrics: int) -> dict[str, float]:
    """The values of ``step``'s metrics event: the same in the log, the COPY and the store's breakdown."""
    return {f"bench/metric_{i:02d}": step * 0.001 + i for i in range(n_metrics)}


def write_log(path: Path, run_id: int, steps: int, n_metrics: int) -> int:
    from tributary.events import EventSink

    sink = EventSink(str(run_id), path)
    for step in range(1, steps + 1):
        sink.metrics(step, step_values(step, n_metrics))
    sink.close()
    return steps * n_metrics


def ship(web_url: str, run_id: int, path: Path, window: int) -> float:
    from tributary.shipper import EventShipper
    from webapp.runs.tokens import ingest_token

    shipper = EventShipper(web_url, run_id, ingest_token(run_id), path, window=window)
    t0 = time.perf_counter()
    shipper.start()
    if not shipper.finish(timeout=900):
        raise SystemExit(f"shipping did not finish: {shipper.error or shipper.last_error_message}")
    return time.perf_counter() - t0


def copy_reference(run_id: int, steps: int, n_metrics: int) -> dict[str, float]:
    """The same rows by psycopg ``COPY`` in one transaction: seconds (connect to commit), the
    client's CPU over them (this thread: building the rows is before) and its backend's CPU
    (``/proc/<backend pid>/stat`` from just after connect to just before close; nan if unreadable)."""
    import psycopg

    now = datetime.now(UTC)
    rows = [
        (run_id, name, step, value, now, step, 1, False)
        for step in range(1, steps + 1)
        for name, value in step_values(step, n_metrics).items()
    ]
    t0, client0 = time.perf_counter(), time.thread_time()
    with psycopg.connect(f"{PG_SERVER}/{BENCH_DB}") as conn:
        backend = conn.info.backend_pid
        backend0 = proc_stat(backend)
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY runs_metricpoint (run_id, name, step, value, time, seq, attempt, superseded) FROM STDIN"
            ) as copy,
        ):
            for row in rows:
                copy.write_row(row)
        conn.commit()
        backend1 = proc_stat(backend)
    seconds, client_cpu = time.perf_counter() - t0, time.thread_time() - client0
    backend_cpu = backend1[1] - backend0[1] if backend0 and backend1 else float("nan")
    return {"s": seconds, "client_cpu": client_cpu, "backend_cpu": backend_cpu}


def throughput_round(
    k: int,
    args: argparse.Namespace,
    web: subprocess.Popen[bytes],
    web_url: str,
    shipped: Any,
    copied: Any,
    workdir: Path,
) -> dict[str, Any]:
    """Round ``k`` (from 0) of the throughput part: a fresh log shipped into ``shipped`` through
    the product, and the same rows by ``COPY`` into ``copied``; even rounds COPY first, odd rounds
    the path first, so a slow period of the machine falls on both. The web app's backends are
    sampled during both parts alike (the sampler's load on the machine is the same for each)."""
    from webapp.runs.models import MetricPoint

    log = workdir / f"events-{shipped.pk}.jsonl"
    points = write_log(log, shipped.pk, args.steps, args.metrics)
    order = ("copy", "path") if k % 2 == 0 else ("path", "copy")
    result: dict[str, Any] = {"round": k + 1, "first": order[0], "points": points}
    for part in order:
        with BackendCPU(web.pid) as backends:
            web0, bench0 = process_cpu_s(web.pid), time.process_time()
            if part == "copy":
                result |= {
                    f"copy_{key}": value
                    for key, value in copy_reference(copied.pk, args.steps, args.metrics).items()
                }
            else:
                result["path_s"] = ship(web_url, shipped.pk, log, args.window)
            web_cpu, bench_cpu = process_cpu_s(web.pid) - web0, time.process_time() - bench0
        backends.conn.close()
        if part == "path":
            # The bench process while shipping: the shipper's thread (the worker's side), the main
            # thread waiting for it, less the sampler's thread.
            result |= {
                "web_cpu": web_cpu,
                "web_backend_cpu": backends.cpu,
                "shipper_cpu": bench_cpu - backends.sampler_cpu,
            }
            result |= {"backends": backends.backends, "appeared": backends.appeared, "gone": backends.gone}
        else:
            result |= {"idle_web_cpu": web_cpu + backends.cpu}  # the web app during COPY: ~0
    for run in (shipped, copied):
        stored = MetricPoint.objects.filter(run=run).count()
        if stored != points:
            raise SystemExit(f"round {k + 1}: stored {stored} of {points} points in run {run.pk}")
    result["ratio"] = result["copy_s"] / result["path_s"]
    result["copy_cpu"] = result["copy_client_cpu"] + result["copy_backend_cpu"]
    result["path_cpu"] = result["web_cpu"] + result["web_backend_cpu"]
    result["cpu_ratio"] = result["copy_cpu"] / result["path_cpu"]
    return result


def report_throughput(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> None:
    points = rounds[0]["points"]
    print(
        f"ingest: {args.steps} metrics events x {args.metrics} values = {points:,} points a round, "
        f"{len(rounds)} rounds (odd rounds COPY first, even rounds the path first); CPU in s"
    )
    print(
        f"{'round':>5} {'first':>5} {'path s':>7} {'COPY s':>7} {'ratio':>6} | {'web app':>7} {'its PG':>7} "
        f"{'= path':>7} | {'COPY cl':>7} {'its PG':>7} {'= COPY':>7} | {'CPU ratio':>9} | {'shipper':>7}"
    )
    for r in rounds:
        print(
            f"{r['round']:5d} {'COPY' if r['first'] == 'copy' else 'path':>5} {r['path_s']:7.2f} {r['copy_s']:7.2f} "
            f"{r['ratio']:6.2f} | {r['web_cpu']:7.2f} {r['web_backend_cpu']:7.2f} {r['path_cpu']:7.2f} | "
            f"{r['copy_client_cpu']:7.2f} {r['copy_backend_cpu']:7.2f} {r['copy_cpu']:7.2f} | "
            f"{r['cpu_ratio']:9.2f} | {r['shipper_cpu']:7.2f}"
        )

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    worst = min(rounds, key=lambda r: r["ratio"])
    print(
        f"median: path {med('path_s'):.2f} s ({points / med('path_s'):,.0f} points/s), "
        f"COPY {med('copy_s'):.2f} s ({points / med('copy_s'):,.0f} points/s)"
    )
    print(
        f"ratio path/COPY: median {med('ratio'):.2f}, worst round {worst['ratio']:.2f} (round {worst['round']}) "
        f"(target >= 0.90 on both, issue 19)"
    )
    # CPU time is what the load of a shared machine changes least: what the path costs the
    # machine (web app + its PostgreSQL backends) against the floor (COPY's client + backend).
    print(
        f"CPU ratio (COPY client + backend) / (web app + its backends): median {med('cpu_ratio'):.2f}, "
        f"worst round {min(r['cpu_ratio'] for r in rounds):.2f}"
    )
    print(
        f"web app CPU while shipping: median {med('web_cpu'):.2f} s ({med('web_cpu') / points * 1e6:.1f} µs a point), "
        f"its backends {med('web_backend_cpu'):.2f} s; COPY client {med('copy_client_cpu'):.2f} s, "
        f"its backend {med('copy_backend_cpu'):.2f} s; shipper (bench process, not in the ratio) "
        f"{med('shipper_cpu'):.2f} s"
    )
    # Cores busy on average: about 1.0 means the parts took turns (a serial pipeline), 2.0 both cores.
    path_busy = statistics.median((r["path_cpu"] + r["shipper_cpu"]) / r["path_s"] for r in rounds)
    copy_busy = statistics.median(r["copy_cpu"] / r["copy_s"] for r in rounds)
    print(
        f"cores busy (CPU / wall, median): path (web app + its backends + shipper) {path_busy:.2f}, "
        f"COPY (client + backend) {copy_busy:.2f}"
    )
    print(
        f"web app's backends while shipping: {max(r['backends'] for r in rounds)} at most, "
        f"{sum(r['appeared'] for r in rounds)} appeared and {sum(r['gone'] for r in rounds)} went "
        f"inside a round (over all rounds); web app + its backends during COPY: "
        f"{max(r['idle_web_cpu'] for r in rounds):.2f} s at most"
    )


class Subscribers:
    """``n`` browser sockets on one run (share link), recording receive minus event time."""

    def __init__(self, url: str, origin: str, n: int, group: str = "") -> None:
        self.url, self.origin, self.n, self.group = url, origin, n, group
        self.latencies: list[float] = []
        self.deliveries: list[tuple[int, float]] = []  # (seq, browser receive time)
        self.written: dict[int, float] = {}  # seq -> the event's own time
        self.announced: dict[int, float] = {}  # seq -> when the group's run.events message arrived
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
        if self.group:
            from channels.layers import get_channel_layer

            self.layer = get_channel_layer()
            self.channel = await self.layer.new_channel()
            await self.layer.group_add(self.group, self.channel)
            self.tasks.append(self.loop.create_task(self._listen_group()))

    async def _listen_group(self) -> None:
        """The run's channel-layer group, as one more member: when the web app announced each event."""
        while True:
            message = await self.layer.receive(self.channel)
            now = time.time()
            if message.get("type") == "run.events":
                for event in message["events"]:
                    self.announced.setdefault(event["seq"], now)

    async def _listen(self, index: int, ws: Any) -> None:
        async for raw in ws:
            now = time.time()
            message = json.loads(raw)
            if message.get("type") != "events":
                continue
            for event in message["events"]:
                if event["type"] == "metrics":
                    self.latencies.append(now - event["time"])
                    self.deliveries.append((event["seq"], now))
                    self.written[event["seq"]] = event["time"]
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
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if self.group:
                await self.layer.group_discard(self.group, self.channel)

        asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class ShipperClock:
    """When the shipper read each event (then sent it) and when each ack came back, by wrapping
    two of its methods from outside: no timing code in the product."""

    def __init__(self, shipper: Any) -> None:
        self.shipper = shipper
        self.sent: dict[int, float] = {}
        self.batches: list[tuple[float, int, int]] = []  # (send time, first seq, last seq)
        self.acks: list[tuple[float, int]] = []  # (time, acked seq)
        read, take_ack = shipper.log.read, shipper._take_ack

        def timed_read(after_seq: int, **options: Any) -> Any:
            batch = read(after_seq, **options)
            if batch:
                now = time.time()
                self.batches.append((now, batch[0][0], batch[-1][0]))
                for seq, _ in batch:
                    self.sent.setdefault(seq, now)
            return batch

        def timed_take_ack(msg: dict[str, Any]) -> None:
            take_ack(msg)
            self.acks.append((time.time(), shipper.acked_seq))

        shipper.log.read, shipper._take_ack = timed_read, timed_take_ack

    def acked(self, seq: int) -> float | None:
        return next((t for t, upto in self.acks if upto >= seq), None)


def proc_stat(pid: int, task: str = "") -> tuple[int, float] | None:
    """(start time in clock ticks, utime + stime in seconds) of a process or, with ``task``, of
    one of its threads (Linux; /proc/<pid>/stat is world-readable, so PostgreSQL's backends, of
    another user, too); None where there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}{task and f'/task/{task}'}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux), in seconds; 0.0 elsewhere."""
    stat = proc_stat(pid)
    return stat[1] if stat else 0.0


def thread_cpu_s(native_id: int | None) -> float:
    """utime + stime of one of this process's threads (Linux), in seconds; 0.0 elsewhere."""
    stat = proc_stat(os.getpid(), str(native_id))
    return stat[1] if stat else 0.0


def tcp_ports(pid: int) -> set[int]:
    """The local ports of a process's TCP sockets (Linux: its fds' socket inodes in its
    /proc/<pid>/net/tcp and tcp6)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()  # no such process (any more)
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class BackendCPU:
    """CPU (utime + stime) of the PostgreSQL backends serving one process (the web app) on the
    bench database over a span: ``pg_stat_activity`` lists the database's client backends, those
    whose ``client_port`` is one of the process's own TCP sockets are its (the bench's own
    connections never are), ``/proc/<pid>/stat`` gives their CPU. Sampled when the span opens,
    every ``interval`` s in a thread, and when it closes, each backend keyed by pid and start
    time (a reused pid is another backend). A backend that appears inside the span counts all
    its CPU (it began there: its start-up is the span's cost); one that goes counts up to its
    last sample (at most ``interval`` s of one core missed for each: ``gone`` says how many).
    The web app pools its connections, so normally the same few backends open and close it."""

    def __init__(self, client_pid: int, interval: float = 0.2) -> None:
        import psycopg

        self.client_pid, self.interval = client_pid, interval
        self.conn = psycopg.connect(f"{PG_SERVER}/{BENCH_DB}", autocommit=True)
        self.theirs: dict[tuple[int, int], bool] = {}  # (backend pid, client port) -> the process's

    def sample(self) -> dict[tuple[int, int], float]:
        rows = self.conn.execute(
            "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchall()
        if new := {row for row in rows if row not in self.theirs}:  # reading /proc/net/tcp takes ms
            ports = tcp_ports(self.client_pid)
            self.theirs |= {(pid, port): port in ports for pid, port in new}
        found = {}
        for pid, port in rows:
            if self.theirs[(pid, port)] and (stat := proc_stat(pid)):
                found[(pid, stat[0])] = stat[1]
        return found

    def __enter__(self) -> BackendCPU:
        self.first = self.sample()
        self.last = dict(self.first)
        self.sampler_cpu = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.last.update(self.sample())
        self.sampler_cpu = time.thread_time()  # this thread's CPU, for the bench process's figure

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        final = self.sample()
        self.last.update(final)
        self.cpu = sum(cpu - self.first.get(key, 0.0) for key, cpu in self.last.items())
        self.backends = len(self.last)
        self.appeared = len(self.last.keys() - self.first.keys())
        self.gone = len(self.last.keys() - final.keys())


POLL_MODES = {
    "fixed": {"poll_interval": 0.05, "poll_min": 0.05},  # the shipper before issue 19
    "adaptive": {},  # the shipper's defaults (a writer in another process: the engine)
    "wake": {"woken": True},  # a writer in this process (tributary.Run)
}


def latency(
    web_url: str,
    port: int,
    run: Any,
    workdir: Path,
    n_subscribers: int,
    n_events: int,
    mode: str = "adaptive",
    window: int = 3,
) -> dict[str, Any]:
    from tributary.events import EventSink
    from tributary.shipper import EventShipper
    from webapp.live.groups import run_group
    from webapp.runs.models import ShareLink
    from webapp.runs.tokens import ingest_token

    link = ShareLink.create(run, None)
    subs = Subscribers(
        f"ws://127.0.0.1:{port}/ws/runs/{run.pk}/?share={link.token}",
        f"http://127.0.0.1:{port}",
        n_subscribers,
        group=run_group(run.pk),
    )
    subs.start()
    path = workdir / f"latency-{run.pk}.jsonl"
    sink = EventSink(str(run.pk), path)
    shipper = EventShipper(web_url, run.pk, ingest_token(run.pk), path, window=window, **POLL_MODES[mode])
    clock = ShipperClock(shipper)
    if mode == "wake":
        sink.on_write = shipper.wake
    shipper.start()
    cpu0, t0 = thread_cpu_s(shipper._thread.native_id), time.monotonic()
    for step in range(1, n_events + 1):
        sink.metrics(step, {"bench/latency": float(step)})
        time.sleep(0.05)
    sink.close()
    ok = subs.wait_for(n_events, timeout=120)
    cpu = thread_cpu_s(shipper._thread.native_id) - cpu0
    wall = time.monotonic() - t0
    shipper.finish(timeout=60)
    subs.close()
    if not ok:
        raise SystemExit(f"subscribers got {min(subs.received)} of {n_events} events")
    return hops(subs, clock) | {
        "mode": mode,
        "cpu_s": cpu,
        "wall_s": wall,
        "empty_reads": shipper.empty_reads,
        "wakeups": shipper.wakeups,
        "batches": len(clock.batches),
    }


def hops(subs: Subscribers, clock: ShipperClock) -> dict[str, Any]:
    """Per-hop latencies (seconds) of every metrics event (per delivery for the browser hops)."""
    written, sent, announced = subs.written, clock.sent, subs.announced
    out: dict[str, list[float]] = {
        "write -> shipper send": [sent[s] - t for s, t in written.items() if s in sent],
        "send -> group send (store, commit)": [
            announced[s] - sent[s] for s in written if s in sent and s in announced
        ],
        "send -> ack at the shipper": [a - sent[s] for s in written if s in sent and (a := clock.acked(s))],
        "group send -> browser socket": [t - announced[s] for s, t in subs.deliveries if s in announced],
        "total: write -> browser socket": list(subs.latencies),
    }
    # Written while the batch before was out, and its batch sent only after that one's ack (a
    # batch that emptied the log is the only one out, shipper.py): it waited for that ack.
    waits: list[float] = []
    for k in range(1, len(clock.batches)):
        out_since, _, prev_last = clock.batches[k - 1]
        ack = clock.acked(prev_last)
        if ack is None or clock.batches[k][0] < ack:
            continue  # sent before the ack: it waited for none
        for seq in range(clock.batches[k][1], clock.batches[k][2] + 1):
            t = written.get(seq)
            if t is not None and out_since < t < ack:
                waits.append(ack - t)
    return {"hops": out, "ack_waits": waits, "events": len(written)}


def store_floor(run: Any, n_events: int) -> list[float]:
    """``store_events`` of one metrics event at a time, called in this process on the same
    PostgreSQL and Redis: the web app's own work on a batch (validate, store, commit, group send),
    without the socket, the consumer and its thread hop. The gap between this and the
    "send -> group send" hop is the ASGI server's share (scheduling, under load)."""
    from webapp.runs.ingest import store_events

    times = []
    for seq in range(1, n_events + 1):
        event = {"run": str(run.pk), "seq": seq, "type": "metrics", "step": seq, "time": time.time()}
        event["values"] = {"bench/latency": float(seq)}
        t0 = time.perf_counter()
        store_events(run.pk, [event])
        times.append(time.perf_counter() - t0)
    return times


STORE_PARTS = (  # (module, function, label): what a store's time is spent on, timed by wrapping them
    ("webapp.runs.ingest", "copy_points", "points' COPY"),  # before the row lock (PostgreSQL)
    ("webapp.runs.ingest", "insert_point_groups", "points' COPY"),  # after it (a batch not prepared, SQLite)
    ("webapp.analysis.rollups", "record", "rollups"),
    ("webapp.analysis.summaries", "record", "summaries"),
    ("webapp.alerts.monitor", "observe", "alert rules"),
)


def store_breakdown(run: Any, steps: int, n_metrics: int) -> dict[str, float]:
    """The throughput round's events stored in this process, batch by batch as the ingest socket
    stores them (``prepare`` first, then ``store_validated``), with each part of the store timed:
    the functions of ``STORE_PARTS`` and the commits (``DatabaseWrapper.commit``), each wrapped for
    this call only (they call through). What the product adds to COPY, part by part, without the
    socket, the shipper and the thread hops (issue 19)."""
    import importlib

    from django.db import DEFAULT_DB_ALIAS, connections

    from tributary.protocol import MAX_BATCH_EVENTS
    from webapp.runs.ingest import prepare, store_validated, validated

    spent: dict[str, float] = {label: 0.0 for *_, label in STORE_PARTS} | {"commits": 0.0}
    undo: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        setattr(owner, name, wrapper)
        undo.append((owner, name, real))

    for module, name, label in STORE_PARTS:
        timed(importlib.import_module(module), name, label)
    timed(type(connections[DEFAULT_DB_ALIAS]), "commit", "commits")
    now = time.time()
    events = [
        {"seq": step, "type": "metrics", "step": step, "time": now, "values": step_values(step, n_metrics)}
        for step in range(1, steps + 1)
    ]
    spent["total"] = 0.0
    try:
        for start in range(0, len(events), MAX_BATCH_EVENTS):
            batch = validated(events[start : start + MAX_BATCH_EVENTS])
            ready = prepare(run.pk, run.attempt_number, batch)  # the socket's reading thread: not timed
            t0 = time.perf_counter()
            store_validated(run.pk, batch, announce_events=False, prepared=ready)
            spent["total"] += time.perf_counter() - t0
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)
    return spent


def print_hops(result: dict[str, Any]) -> None:
    print(
        f"hops ({result['mode']} poll; {result['events']} events in {result['batches']} batches; "
        f"shipper thread CPU {result['cpu_s']:.2f} s in {result['wall_s']:.1f} s, "
        f"{result['empty_reads']} empty reads, {result['wakeups']} wakeups):"
    )
    print(f"  {'hop':<36} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'n':>7}")
    for name, values in result["hops"].items():
        if values:
            print(
                f"  {name:<36} {percentile(values, 0.5) * 1000:8.1f} {percentile(values, 0.99) * 1000:8.1f} "
                f"{max(values) * 1000:8.1f} {len(values):7d}"
            )
    waits = result["ack_waits"]
    share = len(waits) / max(1, result["events"])
    wait = f", p50 wait {percentile(waits, 0.5) * 1000:.1f} ms" if waits else ""
    print(f"  written while the batch before was out (waited for its ack): {share:.0%}{wait}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--subscribers", type=int, default=50)
    parser.add_argument("--latency-events", type=int, default=200)
    parser.add_argument(
        "--rounds", type=int, default=None, help="throughput rounds, alternated (3; 2 with --quick)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="throughput rounds run first and not counted (1): the web app's first batches pay its "
        "warm-up (connections, the cache of clean metric names), which no later round does",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency-only", action="store_true", help="skip the throughput part")
    parser.add_argument("--poll", choices=sorted(POLL_MODES), default="adaptive")
    parser.add_argument("--ab", type=int, default=0, help="rounds of --ab-modes, alternated")
    parser.add_argument("--ab-modes", default="fixed,adaptive")
    parser.add_argument(
        "--window", type=int, default=3, help="batches the shipper keeps out (1: stop-and-wait)"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.subscribers, args.latency_events = 300, 10, 50
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")

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
    modes = [m for m in args.ab_modes.split(",") if m] if args.ab else [args.poll]
    if unknown := set(modes) - set(POLL_MODES):
        raise SystemExit(f"--ab-modes: unknown {sorted(unknown)}; choose from {sorted(POLL_MODES)}")
    rounds = [mode for _ in range(max(1, args.ab)) for mode in modes]
    if args.warmup < 0:
        raise SystemExit("--warmup: 0 or more")
    n_pairs = 0 if args.latency_only else args.warmup + args.rounds
    floor_run, breakdown_run, *runs = make_runs(2 + 2 * n_pairs + len(rounds))
    pair_runs, latency_runs = runs[: 2 * n_pairs], runs[2 * n_pairs :]
    port = free_port()
    web_url = f"http://127.0.0.1:{port}"
    web = start_web(env, port)
    results: list[dict[str, Any]] = []
    try:
        floor = store_floor(floor_run, args.latency_events)
        print(
            f"store_events of one event in this process (no socket): p50 {percentile(floor, 0.5) * 1000:.1f} ms, "
            f"p99 {percentile(floor, 0.99) * 1000:.1f} ms"
        )
        if args.latency_only:
            for mode, run in zip(rounds, latency_runs, strict=True):
                results.append(
                    latency(
                        web_url, port, run, workdir, args.subscribers, args.latency_events, mode, args.window
                    )
                )
                report_latency(args, results[-1])
            return
        throughput = [
            throughput_round(k, args, web, web_url, shipped, copied, workdir)
            for k, (shipped, copied) in enumerate(zip(pair_runs[::2], pair_runs[1::2], strict=True))
        ]
        warmup, throughput = throughput[: args.warmup], throughput[args.warmup :]
        for r in warmup:
            print(
                f"warm-up round (not counted): path {r['path_s']:.2f} s, COPY {r['copy_s']:.2f} s, "
                f"ratio {r['ratio']:.2f}"
            )
        breakdown = store_breakdown(breakdown_run, args.steps, args.metrics)
        settled = settle_writes()
        for mode, run in zip(rounds, latency_runs, strict=True):
            results.append(
                latency(web_url, port, run, workdir, args.subscribers, args.latency_events, mode, args.window)
            )
    finally:
        web.terminate()
        web.wait(timeout=30)
        if len(results) > 1:
            summarize(results)

    report_throughput(args, throughput)
    report_breakdown(breakdown, statistics.median(r["copy_s"] for r in throughput))
    print(
        f"before the latency part: CHECKPOINT and sync, {settled[0]:.2f} s, with {settled[1] / 1024:.0f} MB of the "
        "machine's page cache not yet on disk"
    )
    for result in results:
        report_latency(args, result)


def settle_writes() -> tuple[float, int]:
    """Write what the throughput part left in PostgreSQL's buffers and the page cache to disk
    (``CHECKPOINT``, then ``sync``): (seconds, kB dirty before). Without it the latency part
    measured the kernel's writeback of the ~1.5M points just written (~160 MB dirty here): the
    engine's log writes and the commits' WAL flushes stalled for 100-400 ms now and then (p99
    250-340 ms against 37-45 ms after it or after 15 s of rest, or with ``--latency-only``)."""
    import psycopg

    dirty = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("Dirty:"))
    t0 = time.perf_counter()
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    os.sync()
    return time.perf_counter() - t0, dirty


def report_breakdown(spent: dict[str, float], copy_s: float) -> None:
    total = spent["total"]
    parts = [(label, seconds) for label, seconds in spent.items() if label != "total"]
    rest = total - sum(seconds for _, seconds in parts)
    shown = ", ".join(f"{label} {seconds:.3f}" for label, seconds in [*parts, ("the rest", rest)])
    print(
        f"the same events stored in this process, batch by batch (no socket, no shipper): {total:.2f} s "
        f"(COPY's median {copy_s:.2f} s): {shown}"
    )


def report_latency(args: argparse.Namespace, result: dict[str, Any]) -> None:
    lat = result["hops"]["total: write -> browser socket"]
    print(
        f"latency engine event -> {args.subscribers} browser sockets ({len(lat):,} deliveries, "
        f"{result['mode']} poll): p50 {percentile(lat, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(lat, 0.99) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms, "
        f"mean {statistics.fmean(lat) * 1000:.1f} ms (target p50 < 30, p99 < 100)"
    )
    print_hops(result)


def summarize(results: list[dict[str, Any]]) -> None:
    """Each mode's rounds: median and range of p50 and p99 (end to end), and of the poll hop."""
    print(f"\nA/B over {len(results)} rounds (alternated on one web app), end to end and the poll hop, ms:")
    for mode in dict.fromkeys(r["mode"] for r in results):
        mine = [r for r in results if r["mode"] == mode]
        cells = []
        for label, hop, q in (
            ("p50", "total: write -> browser socket", 0.5),
            ("p99", "total: write -> browser socket", 0.99),
            ("poll p50", "write -> shipper send", 0.5),
        ):
            values = sorted(percentile(r["hops"][hop], q) * 1000 for r in mine)
            cells.append(f"{label} {statistics.median(values):6.1f} [{values[0]:.1f}-{values[-1]:.1f}]")
        cpu = statistics.median(r["cpu_s"] / r["wall_s"] for r in mine)
        print(f"  {mode:<9} n={len(mine)}  " + "  ".join(cells) + f"  shipper CPU {cpu:.1%}")


if __name__ == "__main__":
    main()
