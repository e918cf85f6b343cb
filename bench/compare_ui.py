"""The compare page in headless Chromium: 8 runs x 30 metrics x 10,000 steps, first panel and
all panels drawn.

The same deployment and measurements as ``bench/ui.py`` (imported from it, not copied): uvicorn
serving ``webapp.asgi`` on SQLite, runs inserted straight into the database before the web app
starts (their metric summaries and rollups built as migrations analysis 0001 and 0003 build those
of stored runs: ``bench.ui.backfill``), Debian's Chromium driven by Playwright, signed in through the login form. The page is
``/compare/?runs=<8 ids>&metrics=<all 30>`` so that every metric has its panel (by default the
page opens with the default RL metrics only and adds the rest through its metric search).

- first panel: a ``.chart-panel`` holds points and has its canvas, then one frame (``firstPaint``);
- all panels: every panel has its canvas after ``body[data-history-loaded]``, then one frame;
- "history": when the last ``/metrics/series`` response ended (the page asks every run for the
  first panel's metric first, then for the rest of the shown metrics), "series KB" their weight.

References, in the same run and browser: the same compare page with its history fetched without
downsampling (``max_points=20000``, the API's maximum: every step arrives), and the run page of one
of the runs (``bench/ui.py``'s page: one run, 30 metrics). Targets (issue 18): first panel under
1 s, all panels under 3 s.

    .venv/bin/python bench/compare_ui.py            # 8 x 30 x 10,000, 3 loads each
    .venv/bin/python bench/compare_ui.py --quick    # 8 x 30 x 2,000, 2 loads each
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ui import NAMES, backfill, build_runs, first_chart, signed_in_browser  # noqa: E402
from tests.e2e.browser import prepare_site  # noqa: E402

COLUMNS = ("dom_loaded", "series_kb", "series_end", "first_paint", "all_drawn")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=8, choices=range(1, 13), metavar="N<=12")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=30, choices=range(1, len(NAMES) + 1), metavar="N<=30")
    parser.add_argument("--repeats", type=int, default=3, help="page loads of each page")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 2000, 2

    names = NAMES[: args.metrics]
    workdir = Path(tempfile.mkdtemp(prefix="tributary-compare-bench-"))
    site = prepare_site(workdir, LOG_LEVEL="WARNING")
    t = time.perf_counter()
    ids = build_runs(site, args.runs, args.steps, names)
    built_s = time.perf_counter() - t
    derived_s = backfill(ids)
    site.deployment.start_web()
    compare_url = f"{site.url}/compare/?runs={','.join(map(str, ids))}&metrics={','.join(names)}"
    pages = {
        "compare (the page)": (compare_url, False),
        "compare, no downsampling (ref.)": (compare_url, True),
        "run page of one run (ref.)": (f"{site.url}/runs/{ids[0]}/", False),
    }
    loads: dict[str, list[dict[str, float]]] = {label: [] for label in pages}
    with signed_in_browser(site) as (context, console):
        for _ in range(args.repeats):
            for label, (url, reference) in pages.items():
                loads[label].append(first_chart(context, url, reference))

    n = args.runs * args.metrics * args.steps
    print(f"UI: compare page in headless Chromium, {args.runs} runs x {args.metrics} metrics x {args.steps:,} steps "
          f"= {n:,} points (inserted in {built_s:.1f} s, summaries and rollups built in {derived_s:.1f} s); {args.repeats} loads each, ms from navigation start")  # fmt: skip
    print(f"{'page':<34} {'panels':>6} {'points':>9} {'DOM ready':>9} {'series KB':>9} {'history':>8} "
          f"{'first drawn':>11} {'(max)':>6} {'all drawn':>9} {'(max)':>6}")  # fmt: skip
    med = {}
    for label, rows in loads.items():
        m = {k: statistics.median(r[k] for r in rows) for k in COLUMNS}
        med[label] = m
        print(f"{label:<34} {rows[0]['panels']:6} {rows[0]['points']:9,} {m['dom_loaded']:9.0f} {m['series_kb']:9.0f} "
              f"{m['series_end']:8.0f} {m['first_paint']:11.0f} {max(r['first_paint'] for r in rows):6.0f} "
              f"{m['all_drawn']:9.0f} {max(r['all_drawn'] for r in rows):6.0f}")  # fmt: skip
    page, ref = med["compare (the page)"], med["compare, no downsampling (ref.)"]
    worst_first = max(r["first_paint"] for r in loads["compare (the page)"])
    worst_all = max(r["all_drawn"] for r in loads["compare (the page)"])
    print(f"ratio ref/page: first drawn {ref['first_paint'] / page['first_paint']:.2f}x, "
          f"all drawn {ref['all_drawn'] / page['all_drawn']:.2f}x")  # fmt: skip
    print(f"targets: first panel < 1000 ms: {'met' if worst_first < 1000 else 'MISSED'} (worst {worst_first:.0f}); "
          f"all panels < 3000 ms: {'met' if worst_all < 3000 else 'MISSED'} (worst {worst_all:.0f})")  # fmt: skip
    if console.real():
        print("browser console errors:\n  " + "\n  ".join(console.real()))


if __name__ == "__main__":
    main()
