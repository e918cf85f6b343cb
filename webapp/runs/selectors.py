"""The reads both the JSON API and the pages make: plain functions of a run (or a project,
a user) the caller may already see, returning querysets, rows or plain data.

Who may see what is decided before (``webapp.teams.access``, or a share token); how the API
shows the results is ``webapp.api.serializers``; the pages render them.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import (
    Case,
    Count,
    ExpressionWrapper,
    F,
    FloatField,
    Func,
    IntegerField,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.fields.json import KT
from django.db.models.functions import Floor, Greatest, Least

from webapp.analysis import rollups
from webapp.analysis.models import MetricRollup
from webapp.runs import housekeeping
from webapp.runs.choices import ACTIVE_STATUSES, FINAL_STATUSES, LogLevel, RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, RunAttempt, Sample, ShareLink

# --- runs --------------------------------------------------------------------------------

RUN_SORTS = {
    "created_at": ("created_at", "id"),
    "-created_at": ("-created_at", "-id"),
    "name": ("name", "-id"),
    "-name": ("-name", "-id"),
    "status": ("status", "-created_at", "-id"),
    "-status": ("-status", "-created_at", "-id"),
    "last_step": ("last_step", "-id"),
    "-last_step": ("-last_step", "-id"),
}


def runs_visible_to(user: Any) -> QuerySet[Run]:
    """The runs of the teams ``user`` has a role in."""
    return Run.objects.filter(project__team__memberships__user=user)


def _run_rows(user: Any) -> QuerySet[Run]:
    """The caller's runs as a list of runs shows them (the landing page): project and team in the
    same query, ``total_steps`` read from the config by the database (the config itself, the
    notes and the summary are left behind: a list has no use for them). Archived runs and the
    runs of archived projects are left out (``webapp.runs.housekeeping``)."""
    return (
        housekeeping.listed(runs_visible_to(user).filter(project__archived_at=None))
        .select_related("project__team")
        .defer("config", "notes", "summary")
        .annotate(total_steps=KT("config__trainer__total_steps"))
    )


def active_runs_for(user: Any, limit: int) -> list[Run]:
    """Up to ``limit`` runs of ``user``'s teams that are queued, starting or running, newest
    first, in one query. A run's ``total_steps`` is its config's (text, or None)."""
    return list(_run_rows(user).filter(status__in=ACTIVE_STATUSES).order_by("-created_at", "-id")[:limit])


def recent_runs_for(user: Any, limit: int) -> list[Run]:
    """The ``limit`` runs of ``user``'s teams that finished last (whatever their final state),
    in one query."""
    return list(
        _run_rows(user)
        .filter(status__in=FINAL_STATUSES)
        .order_by(F("finished_at").desc(nulls_last=True), "-id")[:limit]
    )


def run_with_details(run: Run) -> Run:
    """The run again, with what its page shows beside it: project, team, creator, parent, the
    checkpoint it resumes from and ``checkpoint_count`` (those a resume may start from: on its
    history, files still there), in one query."""
    return (
        Run.objects.select_related("project__team", "created_by", "parent", "resume_from")
        .annotate(
            checkpoint_count=Count("checkpoints", filter=Checkpoint.offered("checkpoints__"), distinct=True)
        )
        .get(pk=run.pk)
    )


def run_attempts(run: Run) -> QuerySet[RunAttempt]:
    """The run's attempts, first first, with the checkpoint each started from."""
    return run.attempts.select_related("from_checkpoint").order_by("number")


def resumable_checkpoints(run: Run) -> QuerySet[Checkpoint]:
    """The checkpoints a resume may start from (on the run's history, files still there), newest step first."""
    return run.checkpoints.filter(Checkpoint.offered()).order_by("-step", "-seq")


def run_children(run: Run) -> QuerySet[Run]:
    """The runs forked from ``run`` (or, before a resume continued the same run, resumed), oldest first."""
    return run.children.order_by("created_at", "id").only("id", "name", "status", "parent_kind")


def run_counts(project_ids: list[int]) -> dict[int, dict[str, int]]:
    """Runs by status of each project, in one query."""
    counts: dict[int, dict[str, int]] = {pk: dict.fromkeys(RunStatus.values, 0) for pk in project_ids}
    rows = (
        Run.objects.filter(project_id__in=project_ids)
        .values_list("project_id", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    for project_id, status, n in rows:
        counts[project_id][status] = n
    return counts


def filter_runs(
    qs: QuerySet[Run],
    *,
    statuses: list[str],
    tags: list[str],
    q: str,
    created_by: Any | None,
) -> QuerySet[Run]:
    if statuses:
        qs = qs.filter(status__in=statuses)
    for tag in tags:
        qs = with_tag(qs, tag)
    if q:
        qs = qs.filter(Q(name__icontains=q) | Q(notes__icontains=q))
    if created_by is not None:
        qs = qs.filter(created_by=created_by)
    return qs


def with_tag(qs: QuerySet[Run], tag: str) -> QuerySet[Run]:
    """Runs whose ``tags`` list holds ``tag`` (JSON containment on PostgreSQL, json_each on SQLite)."""
    if connections[qs.db].vendor == "postgresql":
        return qs.filter(tags__contains=[tag])
    table = Run._meta.db_table
    return qs.extra(
        where=[f'EXISTS (SELECT 1 FROM json_each("{table}"."tags") AS t WHERE t.value = %s)'],
        params=[tag],
    )


# --- logs ----------------------------------------------------------------------------------

LEVEL_ORDER = [LogLevel.DEBUG, LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR]


def log_lines(run: Run, *, after_seq: int = 0, level: str | None = None) -> QuerySet[LogLine]:
    """The run's log lines after ``after_seq`` at ``level`` or above, in seq order."""
    qs = LogLine.objects.filter(run=run, seq__gt=after_seq)
    if level:
        qs = qs.filter(level__in=LEVEL_ORDER[LEVEL_ORDER.index(LogLevel(level)) :])
    return qs.order_by("seq")


# --- metrics ---------------------------------------------------------------------------------


def metric_names(run: Run) -> list[dict[str, Any]]:
    """Each metric the run logged: how many points, the step range, the value at the last step."""
    last_value = (
        MetricPoint.objects.filter(run=OuterRef("run"), name=OuterRef("name"), superseded=False)
        .order_by("-step")
        .values("value")[:1]
    )
    rows = (
        MetricPoint.objects.filter(run=run, superseded=False)
        .values("run", "name")
        .annotate(
            count=Count("id"), first_step=Min("step"), last_step=Max("step"), last_value=Subquery(last_value)
        )
        .order_by("name")
    )
    return [{k: v for k, v in row.items() if k != "run"} for row in rows]


def metric_name_list(run: Run) -> list[str]:
    """The names of the run's metrics, sorted: one index probe per name.

    A loose index scan over the unique index (run, name, step): each query asks for the first
    name after the previous one, so 30 metrics of 10,000 points cost 31 index lookups instead
    of reading 300,000 index entries (what ``DISTINCT`` does on both SQLite and PostgreSQL).
    """
    names: list[str] = []
    points = MetricPoint.objects.filter(run=run).order_by("name").values_list("name", flat=True)
    while True:
        following = points.filter(name__gt=names[-1]) if names else points
        name = following.first()
        if name is None:
            return names
        names.append(name)


def has_superseded_points(run: Run) -> bool:
    """Whether a resume from an earlier step superseded some of the run's points."""
    return MetricPoint.objects.filter(run=run, superseded=True).exists()


class Epoch(Func):
    """Unix time in seconds (float) of a datetime column, on PostgreSQL and SQLite."""

    output_field = FloatField()

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra
        )

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # Django stores aware datetimes in SQLite as UTC text, which julianday() reads.
        return self.as_sql(
            compiler, connection, template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)", **extra
        )


def metric_series(
    run: Run,
    names: list[str],
    *,
    exclude: Sequence[str] = (),
    max_points: int,
    after_step: int | None,
    x: str,
    superseded: bool = False,
) -> list[dict[str, Any]]:
    """Each named series in step order, downsampled in the database beyond ``max_points``.

    Downsampling keeps the first and the last point as they are and puts the points between
    them into at most ``max_points - 2`` buckets of equal width along ``x`` (steps, or seconds
    of wall-clock time). A bucket reports its first step and time, the mean value, and the
    minimum and maximum (so a chart can draw the band the mean hides). With ``x=step`` the
    width is the smallest power of two ``w`` for which the buckets ``s // w`` of the steps
    strictly between the first and the last hold at most ``max_points - 2`` (between half
    that and that many): aligned on multiples of ``w``, so the buckets of a long history are
    combined from the blocks kept at ingest (``webapp.analysis.rollups``, at most 8 rows a
    bucket) instead of from every point; the two edge buckets, which share a block with the
    first or the last point, are read as points (at most ``2 w`` of them).

    The run's history by default; with ``superseded`` the points resumes from an earlier step
    replaced instead (several attempts may have one at a step: the latest first), read as points.
    """
    base = MetricPoint.objects.filter(run=run, superseded=superseded)
    if after_step is not None:
        base = base.filter(step__gt=after_step)
    every_name = not names
    if every_name:
        names = metric_name_list(run)
    if exclude:
        names = [n for n in names if n not in set(exclude)]
    if not names:
        return []
    # The history's counts and step ranges come from the coarsest blocks (a row or two a
    # metric); a metric without blocks (points written past ingest), a live read after a step
    # or the superseded points are counted from the points.
    rolled = not superseded and after_step is None
    stats: dict[str, dict[str, Any]] = {}
    if rolled:
        stats = {
            row["name"]: row
            for row in MetricRollup.objects.filter(run=run, width=rollups.WIDTHS[-1], name__in=names)
            .values("name")
            .annotate(n=Sum("count"), lo=Min("first_step"), hi=Max("last_step"))
            .order_by()
        }
    unrolled = [n for n in names if n not in stats]
    if unrolled:
        stats.update(
            (row["name"], {**row, "points": True})
            for row in base.filter(name__in=unrolled)
            .values("name")
            .annotate(n=Count("id"), lo=Min("step"), hi=Max("step"))
            .order_by()
        )
    if every_name:  # only the metrics with points in range (after ``after_step``)
        names = [n for n in names if n in stats]
    out: dict[str, dict[str, Any]] = {}
    whole = [n for n in names if n in stats and stats[n]["n"] <= max_points]
    if whole:
        rows = _raw(
            base.filter(name__in=whole)
            .order_by("name", "step", "-attempt")
            .values_list("name", "step", "value", "time")
        )
        by_name: dict[str, list[tuple[Any, ...]]] = {n: [] for n in whole}
        for name, step, value, time in rows:
            by_name[name].append((step, value, _seconds(time), None, None))
        out.update((n, _series(n, stats[n]["n"], by_name[n], None)) for n in whole)
    # The downsampled ones, four queries for all the metrics with the same step range (a run
    # logs most of its metrics at every step): their first and last points, the blocks, and
    # the points of each edge bucket.
    groups: dict[tuple[int, int, bool], list[str]] = {}
    for name in names:
        st = stats.get(name)
        if st is None:
            out[name] = _series(name, 0, [], None)
        elif st["n"] > max_points:
            groups.setdefault((st["lo"], st["hi"], "points" in st), []).append(name)
    for (lo, hi, from_points), group in groups.items():
        blocks = None if from_points else MetricRollup.objects.filter(run=run)
        for name, (rows, width) in _downsampled(base, blocks, group, lo, hi, max_points, x).items():
            out[name] = _series(name, stats[name]["n"], rows, width)
    return [out[n] for n in names]


def _raw(qs: QuerySet[Any]) -> list[tuple[Any, ...]]:
    """The rows of ``qs`` as the database driver returns them: without Django's converters,
    which cost more than the query for the thousands of rows of a page's series (times are
    read by ``_seconds``)."""
    sql, params = qs.query.sql_with_params()
    with connections[qs.db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


_EPOCH = datetime(1970, 1, 1)
_SECOND = timedelta(seconds=1)


def _seconds(time: Any) -> float:
    """Unix seconds of a datetime column as the driver returns it: an aware datetime
    (PostgreSQL) or the UTC text Django stores in SQLite.

    The text is read as a naive UTC time and its distance from the epoch divided by one second:
    the same float as ``.replace(tzinfo=UTC).timestamp()`` (both divide the whole microseconds by
    10**6, correctly rounded) in a quarter of the time, which counted with one call per point of
    a page's history (9,000 a run of the compare page: 16 of its 140 ms)."""
    if isinstance(time, str):
        parsed = datetime.fromisoformat(time)
        return (parsed - _EPOCH) / _SECOND if parsed.tzinfo is None else parsed.timestamp()
    return time.timestamp()


def _series(name: str, total: int, rows: list[tuple[Any, ...]], width: float | None) -> dict[str, Any]:
    downsampled = width is not None
    return {
        "name": name,
        "total": total,
        "downsampled": downsampled,
        "bucket_width": width,
        "step": [r[0] for r in rows],
        "value": [r[1] for r in rows],
        "time": [r[2] for r in rows],
        "min": [r[3] for r in rows] if downsampled else None,
        "max": [r[4] for r in rows] if downsampled else None,
    }


def step_bucket_width(lo: int, hi: int, buckets: int) -> int:
    """The smallest power of two ``w`` for which the steps strictly between ``lo`` and ``hi`` fall
    in at most ``buckets`` buckets ``s // w``."""
    width = 1
    while (hi - 1) // width - (lo + 1) // width + 1 > buckets:
        width *= 2
    return width


def _downsampled(
    base: QuerySet[MetricPoint],
    blocks: QuerySet[MetricRollup] | None,
    names: list[str],
    lo: int,
    hi: int,
    max_points: int,
    x: str,
) -> dict[str, tuple[list[tuple[Any, ...]], float]]:
    """Series ``names``, each with its first point at step ``lo`` and its last at ``hi``:
    ``{name: (rows, bucket width)}``; ``blocks``: the run's rollups, None to read points only."""
    points = base.filter(name__in=names)
    ends: dict[tuple[str, int], tuple[Any, ...]] = {}
    rows = points.filter(step__in=[lo, hi]).order_by("name", "step", "-attempt")
    for name, step, value, time in _raw(rows.values_list("name", "step", "value", "time")):
        ends.setdefault((name, step), (step, value, _seconds(time), value, value))
    inner = points.filter(step__gt=lo, step__lt=hi)
    buckets = max_points - 2
    body: dict[str, list[tuple[Any, ...]]] = {n: [] for n in names}
    widths: dict[str, float] = {}
    if x == "time":
        # Each series its own time range: one query per series, from its points.
        timed = [n for n in names if ends[n, hi][2] > ends[n, lo][2]]
        for name in timed:
            t_lo, t_hi = ends[name, lo][2], ends[name, hi][2]
            widths[name] = (t_hi - t_lo) / buckets
            # Clamped: a point whose time lies outside the first..last range joins the edge bucket.
            bucket: Any = Least(
                Greatest(Floor((Epoch("time") - Value(t_lo)) / Value(widths[name])), Value(0.0)),
                Value(float(buckets - 1)),
            )
            body[name].extend(_point_buckets(inner.filter(name=name), bucket)[name])
        names = [n for n in names if n not in timed]  # no time range: along steps
    if names:
        width = step_bucket_width(lo, hi, buckets)
        widths.update((n, float(width)) for n in names)
        # Integer division on both databases: an integer column by an integer (steps are >= 0).
        bucket = ExpressionWrapper(F("step") / Value(width), output_field=IntegerField())
        stepped = base.filter(name__in=names)
        # The buckets strictly between the first point's and the last point's hold no point of
        # theirs: combined from the widest blocks that fit, the edge buckets from the points.
        first_bucket, last_bucket = lo // width, hi // width
        fitting = [w for w in rollups.WIDTHS if w <= width]
        if blocks is not None and fitting and last_bucket - first_bucket > 1:
            for name, rows_of in _from_blocks(
                blocks.filter(name__in=names), fitting[-1], width, first_bucket + 1, last_bucket
            ).items():
                body[name].extend(rows_of)
            # Two range scans of the index (run, name, step), each with its own bounds (SQLite
            # bounds a scan by one of several upper bounds: a filter on the inner range's read all).
            edges = [
                stepped.filter(step__gt=lo, step__lt=(first_bucket + 1) * width),
                stepped.filter(step__gte=last_bucket * width, step__lt=hi),
            ]
        else:
            edges = [stepped.filter(step__gt=lo, step__lt=hi)]
        for part in edges:
            for name, rows_of in _point_buckets(part, bucket).items():
                body[name].extend(rows_of)
    out = {}
    for name, rows_of in body.items():
        rows_of.sort(key=lambda r: r[0])
        out[name] = ([ends[name, lo], *rows_of, ends[name, hi]], widths[name])
    return out


SCALED = Case(
    When(value__gt=-rollups.TINY, value__lt=rollups.TINY, then=Value(0.0)),
    default=ExpressionWrapper(F("value") / Value(float(rollups.SCALE)), output_field=FloatField()),
    output_field=FloatField(),
)
"""A value / 2^40: means are summed scaled (``rollups.SCALE``), so values near the largest float
average without overflowing (PostgreSQL raises then), and values under ``rollups.TINY`` count as
0 (their quotient would underflow, which PostgreSQL raises too). SUM / COUNT, not AVG: PostgreSQL's
AVG of a float also sums the squares (for the variance), which overflow from values of 1e154 on."""


def _point_buckets(points: QuerySet[MetricPoint], bucket: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Per name, the buckets of ``points``: first step, mean, first time, min, max."""
    rows = (
        points.annotate(bucket=bucket)
        .values("name", "bucket")
        .annotate(
            s=Min("step"),
            n=Count("id"),
            total=Sum(SCALED),
            t=Min("time"),
            lo_v=Min("value"),
            hi_v=Max("value"),
        )
        .order_by()
        .values_list("name", "s", "n", "total", "t", "lo_v", "hi_v")
    )
    out: dict[str, list[tuple[Any, ...]]] = {}
    for name, s, n, total, t, mn, mx in _raw(rows):
        out.setdefault(name, []).append((s, total / n * rollups.SCALE, _seconds(t), mn, mx))
    return out


def _from_blocks(
    blocks: QuerySet[MetricRollup], block_width: int, width: int, start: int, stop: int
) -> dict[str, list[tuple[Any, ...]]]:
    """Per name, buckets ``start`` to ``stop - 1`` of ``width`` steps, each combined from its
    blocks of ``block_width`` steps (``width / block_width`` of them, at most ``rollups.RATIO``)."""
    per = width // block_width
    rows = (
        blocks.filter(width=block_width, block__gte=start * per, block__lt=stop * per)
        .annotate(bucket=ExpressionWrapper(F("block") / Value(per), output_field=IntegerField()))
        .values("name", "bucket")
        .annotate(
            s=Min("first_step"),
            n=Sum("count"),
            total=Sum("total"),
            t=Min("first_time"),
            mn=Min("min"),
            mx=Max("max"),
        )
        .order_by()
        .values_list("name", "s", "n", "total", "t", "mn", "mx")
    )
    out: dict[str, list[tuple[Any, ...]]] = {}
    for name, s, n, total, t, mn, mx in _raw(rows):
        out.setdefault(name, []).append((s, total / n * rollups.SCALE, _seconds(t), mn, mx))
    return out


CSV_CHUNK_ROWS = 2000
"""Rows per database fetch and per piece of the CSV response: what the web process holds of
an export at a time, whatever its length (a few hundred kB)."""


def metric_csv_rows(run: Run, names: list[str], fmt: str) -> Generator[list[Any], None, None]:
    """The run's metrics as CSV rows, header first, read from a database cursor
    ``CSV_CHUNK_ROWS`` at a time (bounded memory, whatever the export's length).

    ``wide``: a ``step`` column and one column per metric (empty where a metric has no value
    at that step); ``names`` (default: all) picks and orders the columns. ``long``:
    ``step,name,value,time`` (time in ISO 8601, UTC). Values are written with ``repr`` so they
    read back as exactly the stored floats. Closing the generator closes the cursor. Only the
    run's history: not the points a resume from an earlier step superseded."""
    qs = MetricPoint.objects.filter(run=run, superseded=False)
    if names:
        qs = qs.filter(name__in=names)
    else:
        names = list(qs.values_list("name", flat=True).distinct().order_by("name"))
    return _wide_rows(qs, names) if fmt == "wide" else _long_rows(qs)


def _long_rows(qs: QuerySet[MetricPoint]) -> Generator[list[Any], None, None]:
    yield ["step", "name", "value", "time"]
    points = (
        qs.order_by("name", "step")
        .values_list("step", "name", "value", "time")
        .iterator(chunk_size=CSV_CHUNK_ROWS)
    )
    try:
        for step, name, value, time in points:
            yield [step, name, repr(value), time.isoformat()]
    finally:
        points.close()  # the cursor, now, not when the generator is collected


def _wide_rows(qs: QuerySet[MetricPoint], names: list[str]) -> Generator[list[Any], None, None]:
    yield ["step", *names]
    column = {name: i for i, name in enumerate(names)}
    current: int | None = None
    row: list[str] = []
    points = (
        qs.order_by("step", "name").values_list("step", "name", "value").iterator(chunk_size=CSV_CHUNK_ROWS)
    )
    try:
        for step, name, value in points:
            if step != current:
                if current is not None:
                    yield [current, *row]
                current, row = step, [""] * len(names)
            row[column[name]] = repr(value)
    finally:
        points.close()
    if current is not None:
        yield [current, *row]


# --- samples -------------------------------------------------------------------------------

SAMPLE_SORTS = {
    "step": (F("step").asc(), F("seq").asc(), F("index").asc()),
    "-step": (F("step").desc(), F("seq").desc(), F("index").asc()),
    "reward": (F("reward").asc(nulls_last=True), F("step").asc(), F("seq").asc(), F("index").asc()),
    "-reward": (F("reward").desc(nulls_last=True), F("step").asc(), F("seq").asc(), F("index").asc()),
    "length": (F("length").asc(), F("step").asc(), F("seq").asc(), F("index").asc()),
    "-length": (F("length").desc(), F("step").asc(), F("seq").asc(), F("index").asc()),
}


def samples(run: Run, *, q: str = "", step: int | None = None) -> QuerySet[Sample]:
    """The run's samples, at ``step`` if given, whose prompt or completion holds ``q``
    (case-insensitive; ``__search``: the trigram indexes serve it on PostgreSQL); not those a resume from an
    earlier step superseded."""
    qs = Sample.objects.filter(run=run, superseded=False)
    if step is not None:
        qs = qs.filter(step=step)
    if q:
        qs = qs.filter(Q(prompt__search=q) | Q(completion__search=q))
    return qs


def latest_sample_step(run: Run) -> int | None:
    """The last step that has samples (None: none yet)."""
    return Sample.objects.filter(run=run, superseded=False).aggregate(latest=Max("step"))["latest"]


def sample_steps(run: Run) -> list[dict[str, Any]]:
    return [
        {"step": step, "count": count}
        for step, count in Sample.objects.filter(run=run, superseded=False)
        .values("step")
        .annotate(count=Count("id"))
        .order_by("step")
        .values_list("step", "count")
    ]


# --- share links -----------------------------------------------------------------------------


def share_links(run: Run) -> QuerySet[ShareLink]:
    """The run's share links, active and revoked, newest first, with who made each."""
    return run.share_links.select_related("created_by")
