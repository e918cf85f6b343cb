"""The run page in headless Chromium: first chart of a long run, and frames while a run streams.

A real deployment (uvicorn serving ``webapp.asgi``, SQLite, the in-memory channel layer) holds
runs of ``--metrics`` metrics x ``--steps`` steps, inserted straight into the database. Debian's
Chromium (driven by Playwright, tests/e2e/browser.py) signs in through the login form, then:

- first chart: navigation to ``/runs/<id>/`` of a finished run -> the first chart panel holds
  points (``.chart-panel[data-points] > 0``, set by charts.js just before uPlot draws) and the
  frame after it (the chart painted); also all panels drawn and ``body[data-history-loaded]``.
  The page asks for its first panel's series alone, then for the rest: "history" is when the
  last of those responses ended, "series KB" what they weighed together.
  Times are ``performance.now()`` in the page (0 = navigation start), ``--repeats`` loads.
- streaming: the run page of a running run with the same history is open while the worker's
  real ``EventShipper`` ships an engine event log written at ``--rate`` points/s (one metrics
  event of all metrics per step) over the ingest socket; the web app stores and broadcasts each
  batch to the page's run socket. ``requestAnimationFrame`` timestamps give the frame intervals
  over ``--seconds``; long tasks come from a PerformanceObserver.

Reference, in the same run: the same page with its history fetched without downsampling (the
page asks ``/metrics/series?max_points=1000``; here that request is rewritten to
``max_points=20000``, the API's maximum, so every one of the steps arrives). The page itself has
no switch for it. Targets: first chart under 1 s, no frame over 100 ms.

    .venv/bin/python bench/ui.py            # 30 x 10,000, 5,000 points/s for 15 s, 5 loads
    .venv/bin/python bench/ui.py --quick    # 30 x 2,000, 5 s, 3 loads
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.browser import launch_chromium, new_context, prepare_site, sign_in, tributary_playwright  # noqa: E402

# 30 names in the shapes the engine logs, so the page builds its usual panels.
NAMES = [
    "reward/mean", "reward/std", "reward/accuracy/mean", "train/accuracy", "eval/accuracy",
    "actor/entropy", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
    "actor/lr", "actor/pg_loss", "response_length/mean", "response_length/clip_ratio",
    "response_length/max", "response_length/min", "perf/tokens_per_s", "perf/step_s",
    "timing_s/generate", "timing_s/train", "timing_s/reference", "rollout/mismatch_kl",
    "rollout/zero_std_groups", "rollout/filtered", "critic/score_mean", "critic/score_std",
    "critic/advantage_mean", "critic/advantage_std", "data/epoch", "data/prompts_seen",
]  # fmt: skip

# Installed before any page script: frame timestamps, long tasks, and the first drawn chart.
PROBE = """
(() => {
  const w = window;
  w.__bench = { frames: [], recording: false, long: [], firstPoints: null, firstPaint: null };
  const loop = (t) => { if (w.__bench.recording) w.__bench.frames.push(t); requestAnimationFrame(loop); };
  requestAnimationFrame(loop);
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) w.__bench.long.push([e.startTime, e.duration]);
    }).observe({ type: "longtask", buffered: true });
  } catch (err) { /* no long task API */ }
  const seen = () => {
    if (w.__bench.firstPoints !== null) return;
    for (const el of document.querySelectorAll(".chart-panel[data-points]")) {
      if (Number(el.dataset.points) > 0 && el.querySelector("canvas")) {
        w.__bench.firstPoints = performance.now();
        requestAnimationFrame(() => setTimeout(() => { w.__bench.firstPaint = performance.now(); }, 0));
        return;
      }
    }
  };
  new MutationObserver(seen).observe(document, { subtree: true, childList: true, attributes: true,
                                                 attributeFilter: ["data-points"] });
})();
"""


def build_runs(site: Any, n_runs: int, steps: int, names: list[str]) -> list[int]:
    """``n_runs`` runs of the site's project with ``len(names)`` x ``steps`` points each (seq = step),
    written with executemany on the deployment's SQLite file before the web app starts."""
    os.environ.update(site.deployment.env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
    import django

    django.setup()
    from django.db import connection, transaction

    from webapp.runs.models import MetricPoint, Run

    rng = random.Random(0)
    start = datetime.now(UTC) - timedelta(seconds=steps)
    ids = []
    with transaction.atomic():
        for i in range(n_runs):
            run = Run.objects.create(
                project_id=site.project, name=f"ui-bench-{i}", config={"name": f"ui-bench-{i}"}
            )
            ids.append(run.pk)
        table = MetricPoint._meta.db_table
        first = ids[0]
        with connection.cursor() as cursor:
            for k, name in enumerate(names):
                value, rows = float(k), []
                for step in range(1, steps + 1):
                    value += rng.gauss(0, 0.05)
                    rows.append(
                        (first, name, step, value, (start + timedelta(seconds=step)).isoformat(), step)
                    )
                cursor.executemany(
                    f"INSERT INTO {table} (run_id, name, step, value, time, seq, attempt, superseded) "
                    "VALUES (%s, %s, %s, %s, %s, %s, 1, FALSE)",
                    rows,
                )
            for other in ids[1:]:
                cursor.execute(
                    f"INSERT INTO {table} (run_id, name, step, value, time, seq, attempt, superseded) "
                    f"SELECT %s, name, step, value, time, seq, attempt, superseded FROM {table} WHERE run_id = %s",
                    [other, first],
                )
        now = datetime.now(UTC)
        Run.objects.filter(pk__in=ids).update(
            status="running", last_step=steps, last_seq=steps, started_at=start, heartbeat_at=now
        )
        Run.objects.filter(pk=first).update(status="succeeded", finished_at=now)
    connection.close()
    return ids


def backfill(ids: list[int]) -> float:
    """Build the runs' metric summaries and rollups (``webapp.analysis``) as migrations analysis
    0001 and 0003 build them for runs stored before those tables; returns the seconds taken.
    ``build_runs`` writes the points past ingest, which keeps both: without the summaries the
    compare page knows none of the runs' metrics (it reads their names from them) and draws no
    panel; without the rollups every series is aggregated from its points."""
    from django.db import connection, transaction

    from webapp.analysis import rollups, summaries

    t = time.perf_counter()
    with transaction.atomic():
        for run_id in ids:
            summaries.rebuild(run_id)
            rollups.rebuild(run_id)
    connection.close()
    return time.perf_counter() - t


@contextlib.contextmanager
def signed_in_browser(site: Any) -> Iterator[tuple[Any, Any]]:
    """Headless Chromium signed in as ``e2e`` with ``PROBE`` in every page: ``(context, console)``;
    the browser, Playwright's driver and the site's processes are stopped afterwards."""
    gen = tributary_playwright()
    try:
        playwright = next(gen)
        browser = launch_chromium(playwright)
        context, console = new_context(browser)
        context.add_init_script(PROBE)
        sign_in(context.new_page(), site, "e2e")
        yield context, console
        context.close()
        browser.close()
    finally:
        gen.close()  # stops Playwright's driver (its thread would keep the process alive)
        site.deployment.stop_all()


def no_downsampling(route: Any) -> None:
    route.continue_(url=re.sub(r"max_points=\d+", "max_points=20000", route.request.url))


def first_chart(context: Any, url: str, reference: bool) -> dict[str, float]:
    page = context.new_page()
    if reference:
        page.route("**/metrics/series?*", no_downsampling)
    page.goto(url)
    page.wait_for_selector("body[data-history-loaded]", timeout=120_000)
    # A page that loaded its history without a series would never draw: say so now.
    if page.evaluate("() => window.tributaryCharts.store.size") == 0:
        said = page.evaluate("() => (document.getElementById('charts-state') || {}).textContent || ''")
        raise SystemExit(
            f"{url}: the page loaded its history and holds no series ({said.strip() or 'no message'})"
        )
    page.wait_for_function("() => window.__bench.firstPaint !== null", timeout=120_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.chart-panel')].every((p) => p.querySelector('canvas'))",
        timeout=120_000,
    )
    out = page.evaluate(
        """() => {
          const nav = performance.getEntriesByType("navigation")[0];
          const series = performance.getEntriesByType("resource").filter((r) => r.name.includes("/metrics/series"));
          return {
            first_points: window.__bench.firstPoints, first_paint: window.__bench.firstPaint,
            dom_loaded: nav.domContentLoadedEventEnd,
            series_end: Math.max(...series.map((r) => r.responseEnd)),
            series_kb: series.reduce((kb, r) => kb + r.encodedBodySize / 1024, 0),
            points: Number(document.querySelector('#charts').dataset.points),
            panels: document.querySelectorAll('.chart-panel').length,
          };
        }"""
    )
    # All panels drawn: one frame after the last panel got its canvas.
    out["all_drawn"] = page.evaluate("new Promise((r) => requestAnimationFrame(() => r(performance.now())))")
    page.close()
    return out


class Stream:
    """Writes metrics events of ``names`` at ``rate`` points/s into an engine event log, from step
    ``after_step + 1``, and ships it with the worker's EventShipper."""

    def __init__(
        self, site: Any, run_id: int, after_step: int, names: list[str], rate: float, path: Path
    ) -> None:
        from tributary.events import EventSink

        self.site, self.run_id, self.names, self.rate = site, run_id, names, rate
        self.sink = EventSink(str(run_id), path, start_seq=after_step)
        self.step = after_step
        self.path = path
        self.events = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, daemon=True)
        self.shipper: Any = None

    def start(self) -> None:
        from tributary.shipper import EventShipper
        from webapp.runs.tokens import ingest_token

        self.shipper = EventShipper(self.site.url, self.run_id, ingest_token(self.run_id), self.path).start()
        self._thread.start()

    def _write(self) -> None:
        per_s = self.rate / len(self.names)
        t0 = time.perf_counter()
        rng = random.Random(self.run_id)
        while not self._stop.is_set():
            due = int((time.perf_counter() - t0) * per_s)
            while self.events < due:
                self.step += 1
                self.sink.metrics(self.step, {n: k + rng.gauss(0, 0.05) for k, n in enumerate(self.names)})
                self.events += 1
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sink.close()
        if self.shipper is not None and not self.shipper.finish(timeout=120):
            raise SystemExit(
                f"the shipper did not drain: {self.shipper.error or self.shipper.last_error_message}"
            )


def streaming(
    context: Any, site: Any, run_id: int, steps: int, args: Any, reference: bool, workdir: Path
) -> dict:
    page = context.new_page()
    if reference:
        page.route("**/metrics/series?*", no_downsampling)
    page.goto(f"{site.url}/runs/{run_id}/")
    page.wait_for_selector("body[data-history-loaded]", timeout=120_000)
    page.wait_for_function(
        "() => window.tributaryLive && window.tributaryCharts.pointCount() > 0", timeout=120_000
    )
    page.wait_for_selector("#live-state[data-state=open]", timeout=60_000)
    page.wait_for_timeout(1000)  # settle after the history is drawn
    page.evaluate("window.__bench.frames = []; window.__bench.recording = true")
    page.wait_for_timeout(2000)  # the same page idle: what this machine's headless Chromium gives
    idle = page.evaluate("window.__bench.recording = false; window.__bench.frames")
    idle_gaps = [b - a for a, b in itertools.pairwise(idle)]
    before = page.evaluate("window.tributaryCharts.pointCount()")
    stream = Stream(site, run_id, steps, NAMES[: args.metrics], args.rate, workdir / f"events-{run_id}.jsonl")
    page.evaluate("window.__bench.long = []; window.__bench.frames = []; window.__bench.recording = true")
    t0 = time.perf_counter()
    stream.start()
    time.sleep(args.seconds)
    result = page.evaluate(
        """() => { window.__bench.recording = false;
                   return { frames: window.__bench.frames, long: window.__bench.long,
                            points: window.tributaryCharts.pointCount(),
                            step: Number(document.querySelector('#run-step').dataset.step) }; }"""
    )
    elapsed = time.perf_counter() - t0
    stream.stop()
    page.close()
    frames = result["frames"]
    gaps = [b - a for a, b in itertools.pairwise(frames)]
    return {
        "idle_fps": len(idle_gaps) / ((idle[-1] - idle[0]) / 1000) if len(idle_gaps) > 1 else 0.0,
        "idle_max": max(idle_gaps, default=float("nan")),
        "written_points": stream.events * len(stream.names),
        "written_rate": stream.events * len(stream.names) / elapsed,
        "page_step": result["step"],
        "last_written_step": stream.step,
        "points_gained": result["points"] - before,
        "frames": len(frames),
        "fps": (len(gaps) / ((frames[-1] - frames[0]) / 1000)) if len(gaps) > 1 else 0.0,
        "p50": statistics.median(gaps) if gaps else float("nan"),
        "p99": sorted(gaps)[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))] if gaps else float("nan"),
        "max": max(gaps, default=float("nan")),
        "over_100": sum(g > 100 for g in gaps),
        "long_tasks": len(result["long"]),
        "longest_task": max((d for _, d in result["long"]), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=30, choices=range(1, len(NAMES) + 1), metavar="N<=30")
    parser.add_argument("--rate", type=float, default=5000.0, help="points/s streamed")
    parser.add_argument("--seconds", type=float, default=15.0, help="streaming window")
    parser.add_argument("--repeats", type=int, default=5, help="page loads for the first chart")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seconds, args.repeats = 2000, 5.0, 3

    workdir = Path(tempfile.mkdtemp(prefix="tributary-ui-bench-"))
    site = prepare_site(workdir, LOG_LEVEL="WARNING")
    t = time.perf_counter()
    history, stream_down, stream_ref = build_runs(site, 3, args.steps, NAMES[: args.metrics])
    built_s = time.perf_counter() - t
    derived_s = backfill([history, stream_down, stream_ref])
    site.deployment.start_web()
    loads: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    streams: dict[bool, dict] = {}
    with signed_in_browser(site) as (context, console):
        for _ in range(args.repeats):
            for reference in (False, True):
                loads[reference].append(first_chart(context, f"{site.url}/runs/{history}/", reference))
        streams[False] = streaming(context, site, stream_down, args.steps, args, False, workdir)
        streams[True] = streaming(context, site, stream_ref, args.steps, args, True, workdir)

    n = args.metrics * args.steps
    print(f"UI: run page in headless Chromium, {args.metrics} metrics x {args.steps:,} steps = {n:,} points "
          f"(inserted in {built_s:.1f} s, summaries and rollups built in {derived_s:.1f} s); {args.repeats} loads each, times in ms from navigation start")  # fmt: skip
    print(f"{'first chart':<28} {'DOM ready':>9} {'series KB':>9} {'points':>8} {'history':>8} {'first drawn':>12} "
          f"{'(max)':>7} {'all drawn':>10} {'(max)':>7}")  # fmt: skip
    med = {}
    for reference, label in ((False, "downsampled (the page)"), (True, "no downsampling (ref.)")):
        rows = loads[reference]
        m = {
            k: statistics.median(r[k] for r in rows)
            for k in ("dom_loaded", "series_end", "first_paint", "all_drawn", "series_kb")
        }
        med[reference] = m
        print(f"{label:<28} {m['dom_loaded']:9.0f} {m['series_kb']:9.0f} {rows[0]['points']:8,} {m['series_end']:8.0f} "
              f"{m['first_paint']:12.0f} {max(r['first_paint'] for r in rows):7.0f} {m['all_drawn']:10.0f} "
              f"{max(r['all_drawn'] for r in rows):7.0f}")  # fmt: skip
    print(f"ratio first drawn ref/page: {med[True]['first_paint'] / med[False]['first_paint']:.2f}x; "
          f"all drawn: {med[True]['all_drawn'] / med[False]['all_drawn']:.2f}x (target: first chart < 1000 ms)")  # fmt: skip
    print()
    print(f"streaming {args.rate:,.0f} points/s for {args.seconds:.0f} s into a run page holding that history "
          f"(frame intervals in ms)")  # fmt: skip
    print(f"{'streaming':<28} {'written/s':>9} {'gained':>8} {'fps':>6} {'p50':>6} {'p99':>7} {'max':>7} "
          f"{'>100ms':>7} {'long tasks':>10} {'longest':>8}")  # fmt: skip
    for reference, label in ((False, "downsampled (the page)"), (True, "no downsampling (ref.)")):
        s = streams[reference]
        print(f"{label:<28} {s['written_rate']:9,.0f} {s['points_gained']:8,} {s['fps']:6.1f} {s['p50']:6.1f} "
              f"{s['p99']:7.1f} {s['max']:7.1f} {s['over_100']:7} {s['long_tasks']:10} {s['longest_task']:8.0f}")  # fmt: skip
        print(
            f"  (the same page idle for 2 s before: {s['idle_fps']:.1f} fps, max frame {s['idle_max']:.1f} ms)"
        )
        if s["page_step"] < s["last_written_step"] - 2 * args.rate / args.metrics:
            print(
                f"  note: the page was at step {s['page_step']:,} when the writer was at {s['last_written_step']:,}"
            )
    a, b = streams[False], streams[True]
    print(f"ratio max frame ref/page: {b['max'] / a['max']:.2f}x; fps page/ref: "
          f"{a['fps'] / b['fps'] if b['fps'] else float('inf'):.2f}x (target: no frame over 100 ms)")  # fmt: skip
    if console.real():
        print("browser console errors:\n  " + "\n  ".join(console.real()))


if __name__ == "__main__":
    main()
