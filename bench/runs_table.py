"""The runs table with chosen columns: server time on PostgreSQL (issue 18).

A project of ``--runs`` runs (the grpo preset's full config, a sweep over five of its keys), each
with ``--metrics`` metric summaries (``webapp.analysis``, as ingest keeps them) and ``--steps``
points of ``reward/mean`` with their rollup blocks (the sparklines read them: ``--runs 100
--steps 10000`` for long ones). The table's results (what htmx swaps in: the
server's whole answer, middleware and template included) are requested through Django's test
client, ``--rounds`` times each, and the medians compared:

- reference: the table with its default columns, newest first;
- 10 chosen columns (5 config keys, 5 metric summaries), sorted by a metric, filtered by a metric
  comparison and a config value (target < 200 ms);
- the same grouped by two config keys;
- the full page (the pickers list the project's config keys, from its ``ConfigValue`` rows, and
  the metric names of its latest runs).

Each line also gives the median CPU time of this process per request (Python: the view, the
template, the middleware; the rest of the time is the database's and the wait for it: on a shared
machine the steadier figure) and the number of queries, the same at page sizes 10 and 50 (the
tests check it).

    .venv/bin/python bench/runs_table.py            # 2,000 runs x 30 metrics, 15 rounds
    .venv/bin/python bench/runs_table.py --quick    # 500 runs, 5 rounds

Needs the machine's PostgreSQL; creates and drops its own database ``tributary_bench_runs_table``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pg import django_on_fresh_database, drop_database  # noqa: E402

BENCH_DB = "tributary_bench_runs_table"
CONFIG_COLUMNS = (
    "algorithm.clip_ratio_high",
    "rollout.n",
    "optimizer.lr",
    "trainer.seed",
    "algorithm.adv_estimator",
)
METRIC_COLUMNS = (
    "last:reward/mean",
    "max:reward/mean",
    "last:actor/entropy",
    "min:actor/pg_loss",
    "last:eval/accuracy",
)


def seed(n_runs: int, n_metrics: int, steps: int) -> tuple[Any, Any]:
    import copy

    from django.contrib.auth import get_user_model

    from webapp.analysis.config_values import write_many
    from webapp.analysis.models import MetricSummary
    from webapp.runs.bulk import insert_metric_points
    from webapp.runs.models import Run
    from webapp.runs.services import validate_run_config
    from webapp.teams.models import Membership, Project, Team

    team = Team.objects.create(name="Bench", slug="bench")
    project = Project.objects.create(team=team, name="Sweep", slug="sweep")
    user = get_user_model().objects.create_user(username="bench")
    Membership.objects.create(user=user, team=team, role="member")
    base = validate_run_config({"preset": "grpo", "name": "sweep"})
    names = ["reward/mean", "actor/entropy", "actor/pg_loss", "eval/accuracy"] + [
        f"bench/metric_{i:02d}" for i in range(n_metrics - 4)
    ]
    runs = []
    for i in range(n_runs):
        config = copy.deepcopy(base)
        config["name"] = f"sweep-{i:04d}"
        config["algorithm"]["clip_ratio_high"] = (0.2, 0.24, 0.28)[i % 3]
        config["rollout"]["n"] = (4, 8, 16)[(i // 3) % 3]
        config["optimizer"]["lr"] = (1e-6, 3e-6)[(i // 9) % 2]
        config["trainer"]["seed"] = i % 5
        runs.append(
            Run(project=project, created_by=user, name=config["name"], config=config, status="succeeded")
        )
    runs = Run.objects.bulk_create(runs, batch_size=500)
    write_many(runs, created=True)  # bulk_create sends no post_save: the config values by hand
    summaries = []
    for i, run in enumerate(runs):
        for j, name in enumerate(names):
            v = ((i * 37 + j * 11) % 1000) / 1000
            summaries.append(
                MetricSummary(
                    run=run, name=name, last=v, last_step=steps, min=v - 0.1, max=v + 0.1, count=steps
                )
            )
    MetricSummary.objects.bulk_create(summaries, batch_size=5000)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [
        (run.pk, "reward/mean", s, ((i + s) % 100) / 100, t0 + timedelta(seconds=s), s, 1)
        for i, run in enumerate(runs)
        for s in range(1, steps + 1)
    ]
    from django.db import transaction

    with transaction.atomic():
        insert_metric_points(rows)
    from webapp.analysis import rollups

    for run in runs:  # the blocks ingest keeps (points written past it need a rebuild)
        rollups.rebuild(run.pk)
    return project, user


def explain(queries: list[dict[str, Any]]) -> None:
    from django.db import connection

    for q in queries:
        if float(q["time"]) < 0.005 or not q["sql"].startswith("SELECT"):
            continue
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {q['sql']}")
            print(f"--- {q['time']} s: {q['sql'][:300]}")
            print("\n".join(row[0] for row in cursor.fetchall()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--metrics", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--explain", action="store_true", help="print the plans of the slower queries")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards (to explore it)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.rounds = 500, 5

    django_on_fresh_database(BENCH_DB)
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    settings.ALLOWED_HOSTS = ["*"]
    start = time.perf_counter()
    project, user = seed(args.runs, args.metrics, args.steps)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    print(
        f"seeded {args.runs} runs x {args.metrics} summaries + {args.steps} points each in {time.perf_counter() - start:.1f} s"
    )

    client = Client()
    client.force_login(user)
    cols = "&".join([*(f"col=config:{c}" for c in CONFIG_COLUMNS), *(f"col={c}" for c in METRIC_COLUMNS)])
    chosen = f"{cols}&sort=-last:reward/mean&where=last:reward/mean|gt|0.2&where=config:rollout.n|eq|8"
    cases = [
        ("default columns (reference)", "col=", True),
        ("10 columns, sorted + filtered", chosen, True),
        (
            "10 columns, grouped by 2 keys",
            f"{chosen}&group=algorithm.clip_ratio_high&group=trainer.seed",
            True,
        ),
        ("10 columns, full page (pickers)", chosen, False),
    ]
    url = f"/projects/{project.pk}/"
    results = []
    for label, query, partial in cases:
        headers = {"HTTP_HX_REQUEST": "true"} if partial else {}
        response = client.get(f"{url}?{query}", **headers)  # warm-up (and the view is saved)
        assert response.status_code == 200, (label, response.status_code, response.content[:500])
        times, cpu = [], []
        for _ in range(args.rounds):
            t, c = time.perf_counter(), time.process_time()
            with CaptureQueriesContext(connection) as ctx:
                client.get(f"{url}?{query}", **headers)
            times.append((time.perf_counter() - t) * 1000)
            cpu.append((time.process_time() - c) * 1000)
        results.append(
            (label, statistics.median(times), min(times), statistics.median(cpu), len(ctx.captured_queries))
        )
        if args.explain:
            explain(ctx.captured_queries)
    ref = results[0][1]
    print(f"\n{'case':<34} {'median ms':>10} {'min ms':>8} {'x ref':>6} {'cpu ms':>7} {'queries':>8}")
    for label, median, best, cpu_ms, queries in results:
        print(f"{label:<34} {median:>10.1f} {best:>8.1f} {median / ref:>6.2f} {cpu_ms:>7.1f} {queries:>8}")
    print(
        f"\ntarget: 10 columns sorted + filtered under 200 ms -> {'met' if results[1][1] < 200 else 'NOT met'}"
    )
    if not args.keep:
        drop_database(BENCH_DB)


if __name__ == "__main__":
    main()
