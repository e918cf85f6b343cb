"""Ingest throughput and live latency through the whole product path, against psycopg COPY.

Throughput: an engine event log of ``--steps`` metrics events with ``--metrics`` values each
is shipped by the worker's real ``EventShipper`` (two batches out while the log holds a
backlog; ``--window 1``: the stop-and-wait of before) over the ingest socket of a real uvicorn
serving ``webapp.asgi`` on PostgreSQL with the Redis channel layer (store, ack, broadcast
to the run's group with one subscriber). The reference writes the same rows into the same
table with psycopg ``COPY`` in one transaction (the physical floor for getting them into
PostgreSQL). Printed: points/s of each, the ratio (target >= 0.9, issue 19; 0.5 before) and
the web app's CPU time while shipping (the least load-dependent figure on a shared machine).

Latency: ``--subscribers`` browser sockets follow one run through a share link; the engine
side emits ``--latency-events`` metrics events at 20 Hz into the log the shipper tails. For
every event and subscriber: receive time minus the event's own ``time`` (same clock).
Printed: p50, p99 and max, and the same per hop, each timed from outside the product:

- write -> shipper send: the event's ``time`` to the shipper's read of the batch holding it
  (the bench wraps the shipper's ``EventLog.read``; the send follows at once);
- send -> group send: to when a listener the bench adds to the run's channel-layer group
  receives the ``run.events`` message (the web app received, stored, committed, announced);
- send -> ack: to when the shipper holds the ack (what a batch waits for when the shipper's
  window is full: ``--window`` batches out, 2 by default, 1 the stop-and-wait of before);
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
    .venv/bin/python bench/ingest.py --quick    # 300 x 50, 10 subscribers
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
        Run.objects.create(project=project, name=f"bench-{i}", status=RunStatus.RUNNING)
        for i in range(n)
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


def write_log(path: Path, run_id: int, steps: int, n_metrics: int) -> int:
    from tributary.events import EventSink

    sink = EventSink(str(run_id), path)
    names = [f"bench/metric_{i:02d}" for i in range(n_metrics)]
    for step in range(1, steps + 1):
        sink.metrics(step, {name: step * 0.001 + i for i, name in enumerate(names)})
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


def copy_reference(run_id: int, steps: int, n_metrics: int) -> float:
    import psycopg

    names = [f"bench/metric_{i:02d}" for i in range(n_metrics)]
    now = datetime.now(UTC)
    rows = [
        (run_id, name, step, step * 0.001 + i, now, step, 1, False)
        for step in range(1, steps + 1)
        for i, name in enumerate(names)
    ]
    t0 = time.perf_counter()
    with psycopg.connect(f"{PG_SERVER}/{BENCH_DB}") as conn:
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY runs_metricpoint (run_id, name, step, value, time, seq, attempt, superseded) FROM STDIN"
            ) as copy,
        ):
            for row in rows:
                copy.write_row(row)
        conn.commit()
    return time.perf_counter() - t0


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


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux), in seconds; 0.0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int | None) -> float:
    """utime + stime of one of this process's threads (Linux), in seconds; 0.0 elsewhere."""
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    window: int = 2,
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
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency-only", action="store_true", help="skip the throughput part")
    parser.add_argument("--poll", choices=sorted(POLL_MODES), default="adaptive")
    parser.add_argument("--ab", type=int, default=0, help="rounds of --ab-modes, alternated")
    parser.add_argument("--ab-modes", default="fixed,adaptive")
    parser.add_argument("--window", type=int, default=2, help="batches the shipper keeps out (1: stop-and-wait)")
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
    modes = [m for m in args.ab_modes.split(",") if m] if args.ab else [args.poll]
    if unknown := set(modes) - set(POLL_MODES):
        raise SystemExit(f"--ab-modes: unknown {sorted(unknown)}; choose from {sorted(POLL_MODES)}")
    rounds = [mode for _ in range(max(1, args.ab)) for mode in modes]
    shipped_run, copied_run, copied_again, floor_run, *latency_runs = make_runs(4 + len(rounds))
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
                    latency(web_url, port, run, workdir, args.subscribers, args.latency_events, mode, args.window)
                )
                report_latency(args, results[-1])
            return
        points = write_log(workdir / "events.jsonl", shipped_run.pk, args.steps, args.metrics)
        copy_s = copy_reference(copied_run.pk, args.steps, args.metrics)
        web_cpu = process_cpu_s(web.pid)
        path_s = ship(web_url, shipped_run.pk, workdir / "events.jsonl", args.window)
        web_cpu = process_cpu_s(web.pid) - web_cpu
        copy_s = (copy_s + copy_reference(copied_again.pk, args.steps, args.metrics)) / 2

        from webapp.runs.models import MetricPoint

        stored = MetricPoint.objects.filter(run=shipped_run).count()
        if stored != points:
            raise SystemExit(f"stored {stored} of {points} points")
        for mode, run in zip(rounds, latency_runs, strict=True):
            results.append(
                latency(web_url, port, run, workdir, args.subscribers, args.latency_events, mode, args.window)
            )
    finally:
        web.terminate()
        web.wait(timeout=30)
        if len(results) > 1:
            summarize(results)

    print(f"ingest: {args.steps} metrics events x {args.metrics} values = {points:,} points")
    print(f"{'path':<52} {'seconds':>8} {'points/s':>12}")
    print(f"{'psycopg COPY (reference, mean of 2)':<52} {copy_s:8.2f} {points / copy_s:12,.0f}")
    print(f"{'worker -> WebSocket -> PostgreSQL -> broadcast':<52} {path_s:8.2f} {points / path_s:12,.0f}")
    print(f"ratio path/COPY: {copy_s / path_s:.2f} (target >= 0.90, issue 19)")
    # CPU time is what the load of a shared machine changes least: the web app's own work.
    print(f"web app CPU while shipping: {web_cpu:.2f} s ({web_cpu / points * 1e6:.1f} µs a point)")
    for result in results:
        report_latency(args, result)


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
