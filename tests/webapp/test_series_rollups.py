"""Series served from the rollups kept at ingest (``webapp.analysis.rollups``) equal the same
series aggregated from the points, on random histories shipped through ``store_events`` in random
batches: metrics logged at some steps only, a metric logged again at a stored step (its first
value kept), two resumes from earlier checkpoints (the later points superseded), times that go
backwards. Run on SQLite and, with ``DATABASE_URL``, on PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from tests.webapp.event_builders import T0, status
from webapp.analysis import rollups
from webapp.analysis.models import MetricRollup
from webapp.runs import selectors
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import store_events
from webapp.runs.models import MetricPoint, Run
from webapp.runs.services import claim_run, resume_run
from webapp.runs.tokens import check_ingest_token, start_attempt

NAMES = ("loss", "reward/mean", "eval/acc", "lr")


def attempt_events(rng: random.Random, seq: int, steps: range, checkpoints: set[int]) -> list[dict[str, Any]]:
    """One engine attempt's log: metrics at every step (eval/acc every 7th, lr with gaps), a step
    logged again now and then (a repeat of the same values' names with other values), checkpoints,
    a final status."""
    events: list[dict[str, Any]] = [
        {"run": "r", "seq": seq, "type": "status", "state": "starting", "message": ""},
        status(seq + 1, "running"),
    ]
    seq += 2
    for step in steps:
        values = {"loss": rng.gauss(1, 0.5), "reward/mean": rng.random()}
        if step % 7 == 0:
            values["eval/acc"] = rng.random()
        if rng.random() < 0.8:
            values["lr"] = rng.choice([1e-5, 2e-5, -3.0, 1e12])
        # Wall-clock time mostly forward, sometimes back (a clock step): the blocks' earliest time.
        time = T0 + step * 1.25 + rng.choice([0.0, 0.0, 0.5, -40.0]) + rng.random() * 1e-3
        events.append(
            {"run": "r", "seq": seq, "type": "metrics", "step": step, "time": time, "values": values}
        )
        seq += 1
        if rng.random() < 0.05:  # the same step again: the stored first values stay
            again = {name: rng.random() + 10 for name in values}
            events.append(
                {"run": "r", "seq": seq, "type": "metrics", "step": step, "time": time, "values": again}
            )
            seq += 1
        if step in checkpoints:
            events.append(
                {"run": "r", "seq": seq, "type": "checkpoint", "step": step, "path": f"ck/{step}", "bytes": 1}
            )
            seq += 1
    events.append(status(seq, "cancelled"))
    return events


def ship(rng: random.Random, run: Run, events: list[dict[str, Any]]) -> None:
    """Store ``events`` as the attempt's worker does, in random batches (1 to 200 events)."""
    token = start_attempt(run.pk)
    attempt = check_ingest_token(token, run.pk)
    assert claim_run(run.pk, "worker-a", claim=f"claim-{attempt}", attempt=attempt) == (True, "")
    at = 0
    while at < len(events):
        size = rng.choice([1, 2, 5, 40, 200])
        store_events(run.pk, events[at : at + size], attempt=attempt)
        at += size
    run.refresh_from_db()


@pytest.fixture
def rewound_run(make_run: Callable[..., Run], valid_config: dict[str, Any], member: Any) -> Run:
    """Attempt 1 logs steps 0..2999, attempt 2 resumes at 1601 and logs to 3999, attempt 3 resumes
    at 2401 (a checkpoint of attempt 2) and logs to 4499."""
    rng = random.Random(18)
    run = make_run(config=valid_config)
    first = attempt_events(rng, 1, range(0, 3000), {800, 1600, 2400})
    ship(rng, run, first)
    resume_run(run, member, run.checkpoints.get(step=1600, superseded=False))
    second = attempt_events(rng, first[-1]["seq"] + 1, range(1601, 4000), {2400})
    ship(rng, run, second)
    resume_run(run, member, run.checkpoints.get(step=2400, superseded=False, attempt=2))
    ship(rng, run, attempt_events(rng, second[-1]["seq"] + 1, range(2401, 4500), set()))
    assert run.status == RunStatus.CANCELLED and run.attempt_number == 3
    assert MetricPoint.objects.filter(run=run, superseded=True).count() > 2000
    return run


def rollup_rows(run: Run) -> dict[tuple[str, int, int], tuple[Any, ...]]:
    rows = MetricRollup.objects.filter(run=run).values_list(
        "name", "width", "block", "count", "total", "min", "max", "first_step", "last_step", "first_time"
    )
    return {(r[0], r[1], r[2]): r[3:] for r in rows}


def assert_same_rollups(got: dict[Any, tuple[Any, ...]], want: dict[Any, tuple[Any, ...]]) -> None:
    assert got.keys() == want.keys()
    for key, row in got.items():
        other = want[key]
        assert row[0] == other[0] and row[2:] == other[2:], key
        assert row[1] == pytest.approx(other[1], rel=1e-12, abs=1e-300), key  # sums in another order


QUERIES: list[dict[str, Any]] = [
    {"max_points": m, "after_step": a, "x": x}
    for m in (6, 20, 100, 333, 1000)
    for a in (None, 1500, 4400)
    for x in ("step", "time")
] + [{"max_points": m, "after_step": None, "x": "step", "superseded": True} for m in (6, 100)]


def series_of(run: Run, query: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in selectors.metric_series(run, [], **query)}


def assert_same_series(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for name, series in got.items():
        for key in ("total", "downsampled", "bucket_width", "step", "time", "min", "max"):
            assert series[key] == want[name][key], (name, key)
        # A block's mean is its sum over its count, the points' AVG sums in another order.
        assert series["value"] == pytest.approx(want[name]["value"], rel=1e-12, abs=1e-300), name


def python_series(rows: list[tuple[int, int, float, float]], max_points: int) -> dict[str, list[Any]]:
    """The documented rule from the points (step, attempt, value, time): first and last kept (the
    latest attempt's at a step), the steps between in buckets ``s // w``, ``w`` the smallest power
    of two that makes at most ``max_points - 2``; a bucket's first step, mean, earliest time, min, max."""
    rows = sorted(rows, key=lambda r: (r[0], -r[1]))
    if len(rows) <= max_points:
        return {"step": [r[0] for r in rows], "value": [r[2] for r in rows], "time": [r[3] for r in rows],
                "min": None, "max": None}  # fmt: skip
    lo, hi = rows[0][0], rows[-1][0]
    width = selectors.step_bucket_width(lo, hi, max_points - 2)
    last = next(r for r in rows if r[0] == hi)
    buckets: dict[int, list[tuple[int, int, float, float]]] = {}
    for row in rows:
        if lo < row[0] < hi:
            buckets.setdefault(row[0] // width, []).append(row)
    out = [(lo, rows[0][2], rows[0][3], rows[0][2], rows[0][2])]
    for key in sorted(buckets):
        b = buckets[key]
        values = [r[2] for r in b]
        out.append((b[0][0], sum(values) / len(values), min(r[3] for r in b), min(values), max(values)))
    out.append((hi, last[2], last[3], last[2], last[2]))
    return {k: [r[i] for r in out] for i, k in enumerate(("step", "value", "time", "min", "max"))}


def test_rollups_serve_the_series_the_points_give(rewound_run: Run) -> None:
    run = rewound_run
    served = [series_of(run, q) for q in QUERIES]
    assert sum(s["downsampled"] for s in served[0].values()) == len(NAMES)

    # The blocks hold every point of the history once (the repeats and the superseded not),
    # and what ingest kept batch by batch is what a rebuild from the points gives.
    kept = rollup_rows(run)
    for name in NAMES:
        widest = sum(
            row[0] for (n, width, _), row in kept.items() if n == name and width == rollups.WIDTHS[-1]
        )
        assert widest == MetricPoint.objects.filter(run=run, name=name, superseded=False).count()
    rollups.rebuild(run.pk)
    assert_same_rollups(rollup_rows(run), kept)

    # The documented rule, from the points in Python.
    for query, got in zip(QUERIES, served, strict=True):
        if query["x"] == "step" and query["after_step"] is None and "superseded" not in query:
            for name in NAMES:
                points = MetricPoint.objects.filter(run=run, name=name, superseded=False)
                rows = [
                    (s, a, v, t.timestamp())
                    for s, a, v, t in points.values_list("step", "attempt", "value", "time")
                ]
                want = python_series(rows, query["max_points"])
                assert {k: got[name][k] for k in ("step", "time", "min", "max")} == {
                    k: want[k] for k in ("step", "time", "min", "max")
                }, (query, name)
                assert got[name]["value"] == pytest.approx(want["value"], rel=1e-12, abs=1e-300)

    # The same queries from the points alone (a run without blocks is read that way).
    MetricRollup.objects.filter(run=run).delete()
    for query, got in zip(QUERIES, served, strict=True):
        assert_same_series(got, series_of(run, query))


def test_a_batch_stored_whole_is_rolled_up_from_its_events_and_one_with_a_repeat_from_the_rows(
    make_run: Callable[..., Run], valid_config: dict[str, Any]
) -> None:
    """A batch whose points the database all took is aggregated from the events ingest holds (no
    read of the points, issue 19); a batch repeating a stored point (ignored, its first value
    kept) from the rows the database kept, so the repeat is not counted. Either way the blocks
    equal a rebuild from the points: names holding what an array literal escapes, a value under
    ``TINY`` (0 in the sums), values near the largest float, times that go backwards."""
    from django.test.utils import CaptureQueriesContext

    run = make_run(config=valid_config)
    attempt = check_ingest_token(start_attempt(run.pk), run.pk)
    assert claim_run(run.pk, "worker-a", claim=f"claim-{attempt}", attempt=attempt) == (True, "")
    names = ('a "quoted" name', "back\\slash", "comma,{brace}", "tab\tand space", "ünï/cødé")

    def metrics_at(seq: int, step: int, scale: float = 1.0) -> dict[str, Any]:
        values = {name: scale * (i - step / 7) for i, name in enumerate(names)}
        values["huge"], values["-huge"] = 1.7e308, -1.7e308  # one sign each: the sums in any order agree
        time = T0 + step - (40.0 if step % 5 == 0 else 0.0)
        return {"run": "r", "seq": seq, "type": "metrics", "step": step, "time": time, "values": values}

    first = [status(1, "running")] + [metrics_at(2 + step, step) for step in range(40)]
    first.append(
        {"run": "r", "seq": 42, "type": "metrics", "step": 100, "time": T0, "values": {"tiny": 1e-300}}
    )

    def reads_points(events: list[dict[str, Any]]) -> bool:
        with CaptureQueriesContext(connection) as queries:
            store_events(run.pk, events, attempt=attempt)
        rollup_sql = [q["sql"] for q in queries.captured_queries if rollups.ROLLUPS in q["sql"]]
        assert rollup_sql, "no rollups statement"
        return any(rollups.POINTS in sql for sql in rollup_sql)

    assert not reads_points(first)
    # Step 39 again (new seq, same attempt): its first values stay, and count once.
    assert reads_points([metrics_at(43, 39, scale=10.0)] + [metrics_at(44 + i, 101 + i) for i in range(20)])
    assert not reads_points([metrics_at(64 + i, 121 + i) for i in range(3)])
    tiny = MetricRollup.objects.get(run=run, name="tiny", width=rollups.WIDTHS[0])
    assert (tiny.count, tiny.total, tiny.min, tiny.max) == (1, 0.0, 1e-300, 1e-300)

    kept = rollup_rows(run)
    for name in (*names, "huge", "-huge"):
        widest = sum(r[0] for (n, width, _), r in kept.items() if n == name and width == rollups.WIDTHS[-1])
        assert widest == MetricPoint.objects.filter(run=run, name=name).count() == 40 + 20 + 3
    rollups.rebuild(run.pk)
    assert_same_rollups(rollup_rows(run), kept)


def test_a_long_series_reads_blocks_not_its_points(rewound_run: Run) -> None:
    """The buckets between the edge ones come from the blocks: the points read are the first and
    last and the two edge buckets' (at most 2 x 16 here: 4,500 steps in <= 998 buckets)."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        (series,) = selectors.metric_series(rewound_run, ["loss"], max_points=1000, after_step=None, x="step")
    assert series["downsampled"] and series["bucket_width"] == 8.0  # < 16: read from the points
    with CaptureQueriesContext(connection) as queries:
        (series,) = selectors.metric_series(rewound_run, ["loss"], max_points=200, after_step=None, x="step")
    assert series["bucket_width"] == 32.0 and 140 < len(series["step"]) <= 200
    sql = [q["sql"] for q in queries.captured_queries]
    assert any("analysis_metricrollup" in q and '"width" = 16' in q for q in sql), sql


def test_the_migration_builds_the_rollups_of_stored_runs(transactional_db: Any) -> None:
    """0003 fills the table for the runs stored before it, from their points not superseded."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    before = [("analysis", "0002_config_values")]
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    team = old.get_model("teams", "Team").objects.create(name="T", slug="t")
    project = old.get_model("teams", "Project").objects.create(team=team, name="P", slug="p")
    run = old.get_model("runs", "Run").objects.create(name="r", project=project, config={})
    Point = old.get_model("runs", "MetricPoint")
    rng = random.Random(5)
    from datetime import UTC, datetime

    Point.objects.bulk_create(
        Point(
            run=run, name=name, step=step, value=rng.random(), seq=step,
            time=datetime.fromtimestamp(T0 + step, tz=UTC), superseded=step > 900 and name == "a",
        )
        for name in ("a", "b")
        for step in range(0, 1200)
    )  # fmt: skip
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    run = Run.objects.get(pk=run.pk)
    migrated = rollup_rows(run)
    assert sum(r[0] for (n, w, _), r in migrated.items() if n == "a" and w == 16) == 901
    rollups.rebuild(run.pk)
    assert_same_rollups(rollup_rows(run), migrated)
    assert MetricRollup._meta.db_table == rollups.ROLLUPS and MetricPoint._meta.db_table == rollups.POINTS


def test_values_near_the_largest_float_neither_fail_ingest_nor_the_series(
    make_run: Callable[..., Run], valid_config: dict[str, Any]
) -> None:
    """Sums of such values overflow (PostgreSQL raises, which would quarantine the batch): the
    blocks keep them scaled by 2^-40 and the points are averaged the same way."""
    rng = random.Random(1)
    run = make_run(config=valid_config)
    big = 1.7e308
    events = [status(1, "starting"), status(2, "running")] + [
        {"run": "r", "seq": 3 + step, "type": "metrics", "step": step, "time": T0 + step,
         "values": {"huge": big, "tiny": -big}}
        for step in range(3000)
    ]  # fmt: skip
    ship(rng, run, events)
    assert not run.log_lines.filter(level="error").exists()  # nothing quarantined
    served = series_of(run, {"max_points": 100, "after_step": None, "x": "step"})
    assert served["huge"]["value"] == pytest.approx([big] * len(served["huge"]["step"]), rel=1e-15)
    assert served["tiny"]["min"] == [-big] * len(served["tiny"]["step"])
    MetricRollup.objects.filter(run=run).delete()
    assert_same_series(served, series_of(run, {"max_points": 100, "after_step": None, "x": "step"}))


def test_values_near_the_smallest_float_neither_fail_ingest_nor_the_series(
    make_run: Callable[..., Run], valid_config: dict[str, Any]
) -> None:
    """A subnormal is a finite value a run may log; divided by 2^40 it underflows to 0, which
    PostgreSQL refuses (the batch was quarantined): values under ``rollups.TINY`` count as 0 in the
    means, in the blocks and in the points' own means alike; min and max keep them exactly."""
    rng = random.Random(2)
    run = make_run(config=valid_config)
    events = [status(1, "starting"), status(2, "running")] + [
        {"run": "r", "seq": 3 + step, "type": "metrics", "step": step, "time": T0 + step,
         "values": {"subnormal": 5e-324, "small": -2.5e-310 if step % 2 else 1e-300, "one": 1.0}}
        for step in range(3000)
    ]  # fmt: skip
    ship(rng, run, events)
    assert not run.log_lines.filter(level="error").exists()  # nothing quarantined
    assert MetricPoint.objects.filter(run=run, name="subnormal").count() == 3000
    served = series_of(run, {"max_points": 100, "after_step": None, "x": "step"})
    sub = served["subnormal"]
    assert sub["value"][0] == sub["value"][-1] == 5e-324  # the first and last points as they are
    assert sub["value"][1:-1] == [0.0] * (len(sub["step"]) - 2)  # bucket means: counted as 0
    assert sub["min"][1:-1] == sub["max"][1:-1] == [5e-324] * (len(sub["step"]) - 2)
    assert max(map(abs, served["small"]["value"])) < rollups.TINY
    assert served["one"]["value"] == [1.0] * len(served["one"]["step"])
    MetricRollup.objects.filter(run=run).delete()
    assert_same_series(served, series_of(run, {"max_points": 100, "after_step": None, "x": "step"}))
