"""Keeping ``MetricSummary`` rows at ingest: one upsert per events batch.

``record`` folds a batch's metric points into the stored summaries in one statement
(``INSERT ... ON CONFLICT (run, name) DO UPDATE``, on PostgreSQL and SQLite alike): min and max
combine with LEAST/GREATEST (``min``/``max`` of two arguments on SQLite), the count adds up, and the
last value moves only to a point at a later step than the stored one (a step logged again keeps
its first value, as the points do: ``bulk.py`` ignores the repeat). ``rebuild`` recomputes a run's summaries from its points
not superseded, for a resume that rewound the run (``webapp.runs.ingest._supersede``): min, max and
the last value of a rewound history cannot be derived from the old summary.

Both run inside ingest's transaction, under the run's row lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import connection, connections
from django.db.models import Count, Max, Min, OuterRef, Subquery

from webapp.analysis.models import MetricSummary

if TYPE_CHECKING:
    from webapp.runs.bulk import PointGroup

MAX_ROWS_PER_STATEMENT = 500  # 7 parameters a row: well under SQLite's 32,766 and PostgreSQL's 65,535


def _folded(groups: Iterable[PointGroup], stored: dict[str, int]) -> dict[str, list[Any]]:
    """Per name: [last, last_step, min, max, count, attempt of the last], points in seq order.

    A metric an attempt logs twice at one step is stored once (its first value, ``bulk.py``'s
    ignore-conflicts); the repeat is recognised here as the same step and attempt as the metric's
    latest point, which is where an engine repeats one (one pass, no set of every point: this runs
    for every point ingested), or, across batches, as a step at or before the summary's stored
    ``last_step`` (``stored``). A rewind's earlier steps are left to ``rebuild``. The loop is over
    the events and, inside, their values: no tuple a point (issue 19)."""
    out: dict[str, list[Any]] = {}
    get = out.get
    for _run, step, _time, _seq, attempt, values in groups:
        for name, value in values.items():
            if stored and step <= stored.get(name, -1):
                continue
            row = get(name)
            if row is None:
                out[name] = [value, step, value, value, 1, attempt]
                continue
            if step == row[1] and attempt == row[5]:
                continue
            if step >= row[1]:
                row[0], row[1], row[5] = value, step, attempt
            if value < row[2]:
                row[2] = value
            elif value > row[3]:
                row[3] = value
            row[4] += 1
    return out


def fold_new(groups: Sequence[PointGroup]) -> dict[str, list[Any]]:
    """``groups`` folded as ``record`` folds a batch whose points are all past the run's stored
    summaries (``steps_to``): pure Python, so ingest builds it before it takes the run's row lock,
    beside the batch before in the database (issue 19)."""
    return _folded([group for group in groups if group.values], {})


def record(
    groups: Sequence[PointGroup], *, steps_to: int | None = None, new: dict[str, list[Any]] | None = None
) -> None:
    """Fold ``groups`` (a batch's metrics events as ingest stores them, one run's) into the
    summaries: one statement per 500 metric names of the batch (a batch of one run's steps has tens).

    ``steps_to``: a step no stored summary of the run is past (ingest passes the run's last step,
    which every counted point moved and a rewind lowers only after ``rebuild``). When every point
    is after it, no stored ``last_step`` can skip one, and reading them is saved (issue 19); then
    ``new``, when given, is taken as the fold (``fold_new(groups)``, built by the caller before)."""
    groups = [group for group in groups if group.values]
    if not groups:
        return
    run_ids = {group.run_id for group in groups}
    assert len(run_ids) == 1, "a batch is one run's"
    run_id = run_ids.pop()
    if steps_to is not None and min(group.step for group in groups) > steps_to:
        folded = fold_new(groups) if new is None else new
    else:
        names = {name for group in groups for name in group.values}
        summaries = MetricSummary.objects.filter(run_id=run_id, name__in=names)
        folded = _folded(groups, dict(summaries.values_list("name", "last_step")))
    if not folded:
        return
    table = connection.ops.quote_name(MetricSummary._meta.db_table)
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")
    rows = [(run_id, name, *values[:5]) for name, values in folded.items()]
    merge = (
        "ON CONFLICT (run_id, name) DO UPDATE SET "
        "last = CASE WHEN excluded.last_step > s.last_step THEN excluded.last ELSE s.last END, "
        f"last_step = {greatest}(s.last_step, excluded.last_step), "
        f"min = {least}(s.min, excluded.min), max = {greatest}(s.max, excluded.max), "
        "count = s.count + excluded.count"
    )
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":  # one array a column: 7 parameters whatever the size
            cursor.execute(
                f"INSERT INTO {table} AS s (run_id, name, last, last_step, min, max, count) "
                "SELECT * FROM unnest(%s::bigint[], %s::varchar[], %s::double precision[], %s::integer[], "
                f"%s::double precision[], %s::double precision[], %s::integer[]) {merge}",
                [list(c) for c in zip(*rows, strict=True)],
            )
            return
        for start in range(0, len(rows), MAX_ROWS_PER_STATEMENT):
            chunk = rows[start : start + MAX_ROWS_PER_STATEMENT]
            placeholders = ", ".join(["(%s, %s, %s, %s, %s, %s, %s)"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {table} AS s (run_id, name, last, last_step, min, max, count) "
                f"VALUES {placeholders} {merge}",
                [value for row in chunk for value in row],
            )


def rebuild(run_id: int) -> None:
    """Recompute run ``run_id``'s summaries from its points not superseded (after a rewind):
    four queries, whatever the number of metrics."""
    from webapp.runs.models import MetricPoint  # the runs app imports this module at ingest

    MetricSummary.objects.filter(run_id=run_id).delete()
    MetricSummary.objects.bulk_create(summaries_from_points(MetricPoint, run_id), batch_size=500)


def summaries_from_points(point_model: Any, run_id: int, summary_model: Any = MetricSummary) -> list[Any]:
    """A run's summaries computed from its stored points (``point_model``: the model class, or
    the migration's historical one for the backfill).

    The last values are a query of their own on PostgreSQL (``DISTINCT ON``: one pass over the
    index (run, name, step, attempt)): as an annotation of the grouped query, Django adds the
    correlated subquery to the GROUP BY, and PostgreSQL then runs it once per *point* (minutes
    for a rewound run of 10,000 points, ``tests/webapp/test_series_rollups.py``)."""
    history = point_model.objects.filter(run_id=run_id, superseded=False)
    newest_first = ("-step", "-attempt", "-seq")
    aggregates = {"lo": Min("value"), "hi": Max("value"), "n": Count("id"), "at": Max("step")}
    if connections[history.db].vendor == "postgresql":
        rows = list(history.values("name").annotate(**aggregates).order_by())
        last = dict(history.order_by("name", *newest_first).distinct("name").values_list("name", "value"))
        for r in rows:
            r["last"] = last[r["name"]]
    else:
        last_value = history.filter(name=OuterRef("name")).order_by(*newest_first).values("value")[:1]
        rows = list(history.values("name").annotate(**aggregates, last=Subquery(last_value)).order_by())
    return [
        summary_model(
            run_id=run_id,
            name=r["name"],
            last=r["last"],
            last_step=r["at"],
            min=r["lo"],
            max=r["hi"],
            count=r["n"],
        )
        for r in rows
    ]
