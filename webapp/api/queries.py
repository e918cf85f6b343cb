"""What the endpoints read, as plain functions of a run the caller may already see.

The routers check who may see what (``webapp.teams.access`` or a share token) and then call
these, so the team API and the read-only share API return exactly the same data.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import AsyncGenerator, Generator, Sequence
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.db import connections
from django.db.models import (
    Avg,
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
    Value,
)
from django.db.models.functions import Floor, Greatest, Least
from django.http import StreamingHttpResponse
from django.utils.text import slugify
from ninja.errors import ValidationError

from webapp.inputs import INT_MAX, parse_id
from webapp.runs.choices import ACTIVE_STATUSES, FINAL_STATUSES, LogLevel, RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample, ShareLink
from webapp.teams.access import memberships_of
from webapp.teams.choices import Role
from webapp.teams.models import Project, Team


def query_error(param: str, msg: str, kind: str = "value_error") -> ValidationError:
    """A 422 in ninja's own shape, naming a query parameter."""
    return ValidationError([{"type": kind, "loc": ["query", param], "msg": msg}])


# --- teams and projects ------------------------------------------------------------------


def team_ref(team: Team) -> dict[str, Any]:
    return {"id": team.pk, "name": team.name, "slug": team.slug}


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


def project_out(
    project: Project, role: Role | str | None, counts: dict[int, dict[str, int]] | None = None
) -> dict[str, Any]:
    if counts is None:
        counts = run_counts([project.pk])
    return {
        "id": project.pk,
        "team": team_ref(project.team),
        "name": project.name,
        "slug": project.slug,
        "description": project.description,
        "created_at": project.created_at,
        "role": str(role) if role else None,
        "run_counts": counts[project.pk],
    }


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


def teams_out(user: Any) -> list[dict[str, Any]]:
    """The caller's teams with their role in each (``/me`` and ``/teams``)."""
    return [
        {
            "id": m.team.pk,
            "name": m.team.name,
            "slug": m.team.slug,
            "role": m.role,
            "created_at": m.team.created_at,
        }
        for m in memberships_of(user)
    ]


def checkpoint_out(ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "id": ckpt.pk,
        "run_id": ckpt.run_id,
        "step": ckpt.step,
        "seq": ckpt.seq,
        "path": ckpt.path,
        "bytes": ckpt.bytes,
        "created_at": ckpt.created_at,
    }


def run_list_item(run: Run) -> dict[str, Any]:
    return {
        "id": run.pk,
        "name": run.name,
        "project_id": run.project_id,
        "status": run.status,
        "status_badge": run.status_badge,
        "status_message": run.status_message,
        "created_at": run.created_at,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "created_by": run.created_by.get_username() if run.created_by else None,
        "queue": run.queue,
        "tags": list(run.tags or []),
        "last_step": run.last_step,
        "parent_id": run.parent_id,
        "parent_kind": run.parent_kind,
        "summary": dict(run.summary or {}),
    }


def run_out(run: Run, role: Role | str | None) -> dict[str, Any]:
    """Everything the run page needs; ``role`` is the caller's (None through a share link)."""
    run = (
        Run.objects.select_related("project__team", "created_by", "parent", "resume_from")
        .annotate(checkpoint_count=Count("checkpoints", distinct=True))
        .get(pk=run.pk)
    )
    status = RunStatus(run.status)
    is_member = role is not None and Role(role).at_least(Role.MEMBER)
    children = [
        {"id": c.pk, "name": c.name, "status": c.status, "kind": c.parent_kind}
        for c in run.children.order_by("created_at", "id").only("id", "name", "status", "parent_kind")
    ]
    return {
        **run_list_item(run),
        "project": {
            "id": run.project.pk,
            "name": run.project.name,
            "slug": run.project.slug,
            "team": team_ref(run.project.team),
        },
        "notes": run.notes,
        "config": run.config,
        "heartbeat_at": run.heartbeat_at,
        "worker_host": run.worker_host,
        "cancel_requested_at": run.cancel_requested_at,
        "is_final": status in FINAL_STATUSES,
        "last_seq": run.last_seq,
        "parent": (
            {"id": run.parent.pk, "name": run.parent.name, "status": run.parent.status}
            if run.parent
            else None
        ),
        "resume_from": checkpoint_out(run.resume_from) if run.resume_from else None,
        "children": children,
        "checkpoint_count": run.checkpoint_count,
        "role": str(role) if role else None,
        "permissions": {
            "edit": is_member,
            "cancel": is_member and status in ACTIVE_STATUSES and run.cancel_requested_at is None,
            "resume": is_member and status in FINAL_STATUSES and run.checkpoint_count > 0,
            "fork": is_member,
            "share": is_member,
        },
    }


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


def log_page(run: Run, after_seq: int, level: str | None, limit: int) -> dict[str, Any]:
    qs = LogLine.objects.filter(run=run, seq__gt=after_seq)
    if level:
        at_least = LEVEL_ORDER[LEVEL_ORDER.index(LogLevel(level)) :]
        qs = qs.filter(level__in=at_least)
    rows = list(qs.order_by("seq")[: limit + 1])
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "items": [{"seq": r.seq, "level": r.level, "message": r.message, "time": r.time} for r in rows],
        "next_after_seq": rows[-1].seq if rows else after_seq,
        "has_more": has_more,
    }


# --- metrics ---------------------------------------------------------------------------------


def metric_names(run: Run) -> list[dict[str, Any]]:
    """Each metric the run logged: how many points, the step range, the value at the last step."""
    last_value = (
        MetricPoint.objects.filter(run=OuterRef("run"), name=OuterRef("name"))
        .order_by("-step")
        .values("value")[:1]
    )
    rows = (
        MetricPoint.objects.filter(run=run)
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


def split_names(names: list[str] | None) -> list[str]:
    """``names=a,b`` and ``names=a&names=b`` alike; order kept, duplicates dropped."""
    out: list[str] = []
    for item in names or []:
        for name in item.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


def metric_series(
    run: Run,
    names: list[str],
    *,
    exclude: Sequence[str] = (),
    max_points: int,
    after_step: int | None,
    x: str,
) -> list[dict[str, Any]]:
    """Each named series in step order, downsampled in the database beyond ``max_points``.

    Downsampling keeps the first and the last point as they are and puts the points between
    them into at most ``max_points - 2`` buckets of equal width along ``x`` (steps, or seconds
    of wall-clock time). A bucket reports its first step and time, the mean value, and the
    minimum and maximum (so a chart can draw the band the mean hides). With ``x=step`` a
    point at step s falls in bucket ``(s - first - 1) // width`` where
    ``width = ceil((last - first - 1) / (max_points - 2))``.
    """
    base = MetricPoint.objects.filter(run=run)
    if after_step is not None:
        base = base.filter(step__gt=after_step)
    every_name = not names
    if every_name:
        names = metric_name_list(run)
    if exclude:
        names = [n for n in names if n not in set(exclude)]
    if not names:
        return []
    stats = {
        row["name"]: row
        for row in base.filter(name__in=names)
        .values("name")
        .annotate(n=Count("id"), lo=Min("step"), hi=Max("step"))
        .order_by()
    }
    if every_name:  # only the metrics with points in range (after ``after_step``)
        names = [n for n in names if n in stats]
    out = []
    for name in names:
        st = stats.get(name)
        points = base.filter(name=name)
        if st is None:
            out.append(_series(name, 0, [], None))
        elif st["n"] <= max_points:
            rows = points.order_by("step").values_list("step", "value", "time")
            out.append(_series(name, st["n"], [(s, v, t.timestamp(), None, None) for s, v, t in rows], None))
        else:
            rows, width = _downsampled(points, st["lo"], st["hi"], max_points, x)
            out.append(_series(name, st["n"], rows, width))
    return out


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


def _downsampled(
    points: QuerySet[MetricPoint], lo: int, hi: int, max_points: int, x: str
) -> tuple[list[tuple[Any, ...]], float]:
    first = points.filter(step=lo).values_list("step", "value", "time").get()
    last = points.filter(step=hi).values_list("step", "value", "time").get()
    inner = points.filter(step__gt=lo, step__lt=hi)
    buckets = max_points - 2
    t_lo, t_hi = first[2].timestamp(), last[2].timestamp()
    if x == "time" and t_hi > t_lo:
        width: float = (t_hi - t_lo) / buckets
        # Clamped: a point whose time lies outside the first..last range joins the edge bucket.
        bucket: Any = Least(
            Greatest(Floor((Epoch("time") - Value(t_lo)) / Value(width)), Value(0.0)),
            Value(float(buckets - 1)),
        )
    else:
        width = max(1, math.ceil((hi - lo - 1) / buckets))
        # Integer division on both databases: an integer column by an integer.
        bucket = ExpressionWrapper(
            (F("step") - Value(lo + 1)) / Value(int(width)), output_field=IntegerField()
        )
    rows = (
        inner.annotate(bucket=bucket)
        .values("bucket")
        .annotate(s=Min("step"), v=Avg("value"), lo_v=Min("value"), hi_v=Max("value"), t=Min("time"))
        .order_by("bucket")
        .values_list("s", "v", "t", "lo_v", "hi_v")
    )
    body = [(s, v, t.timestamp(), mn, mx) for s, v, t, mn, mx in rows]
    body.sort(key=lambda r: r[0])
    ends = [(p[0], p[1], p[2].timestamp(), p[1], p[1]) for p in (first, last)]
    return [ends[0], *body, ends[1]], float(width)


CSV_CHUNK_ROWS = 2000
"""Rows per database fetch and per piece of the CSV response: what the web process holds of
an export at a time, whatever its length (a few hundred kB)."""


def metrics_csv(run: Run, names: list[str], fmt: str, *, asynchronous: bool = False) -> StreamingHttpResponse:
    """The run's metrics as CSV, streamed from the database with bounded memory.

    ``wide``: a ``step`` column and one column per metric (empty where a metric has no value
    at that step). ``long``: ``step,name,value,time`` (time in ISO 8601, UTC). Values are
    written with ``repr`` so they read back as exactly the stored floats.

    Rows come from a database cursor ``CSV_CHUNK_ROWS`` at a time (a server-side cursor on
    PostgreSQL) and leave as pieces of that many rows. Under ASGI (``asynchronous``) the body
    is an async iterator: Django consumes a sync iterator there by reading it whole into a
    list first ("StreamingHttpResponse must consume synchronous iterators in order to serve
    them asynchronously"), which holds the whole file in memory. Under WSGI it stays a sync
    iterator (the async one would be read whole for the opposite reason).
    """
    qs = MetricPoint.objects.filter(run=run)
    if names:
        qs = qs.filter(name__in=names)
    else:
        names = list(qs.values_list("name", flat=True).distinct().order_by("name"))
    rows = _wide_rows(qs, names) if fmt == "wide" else _long_rows(qs)
    chunks = _csv_chunks(rows)
    response = StreamingHttpResponse(
        _async_chunks(chunks) if asynchronous else chunks, content_type="text/csv; charset=utf-8"
    )
    filename = f"run-{run.pk}-{slugify(run.name) or 'run'}-metrics{'-long' if fmt == 'long' else ''}.csv"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _csv_chunks(rows: Generator[list[Any], None, None]) -> Generator[str, None, None]:
    """CSV text of ``CSV_CHUNK_ROWS`` rows at a time. Closing it (a client that went away)
    closes ``rows`` and so the database cursor under them."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    try:
        count = 0
        for row in rows:
            writer.writerow(row)
            count += 1
            if count == CSV_CHUNK_ROWS:
                yield buffer.getvalue()
                buffer.seek(0)
                buffer.truncate()
                count = 0
        if count:
            yield buffer.getvalue()
    finally:
        rows.close()


async def _async_chunks(chunks: Generator[str, None, None]) -> AsyncGenerator[str, None]:
    """``chunks`` for an ASGI server, one piece at a time. Each piece is read in the request's
    own thread (``thread_sensitive``: the thread that holds its database connection). When the
    client disconnects, Django cancels the response task or closes this generator; either way
    ``chunks`` is closed in that thread, which closes the cursor."""
    next_chunk = sync_to_async(next, thread_sensitive=True)
    try:
        while (chunk := await next_chunk(chunks, None)) is not None:
            yield chunk
    finally:
        await sync_to_async(chunks.close, thread_sensitive=True)()


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
    points = qs.order_by("step", "name").values_list("step", "name", "value").iterator(chunk_size=CSV_CHUNK_ROWS)
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


def parse_step(step: str | None) -> int | str | None:
    if step is None or step == "":
        return None
    if step == "latest":
        return "latest"
    value = parse_id(step, INT_MAX)  # ASCII digits within the column's range: not "²", not -1
    if value is None:
        raise query_error("step", f"must be a step number (0 to {INT_MAX}) or 'latest', got {step!r}")
    return value


def sample_page(run: Run, *, step: str | None, q: str, sort: str, limit: int, offset: int) -> dict[str, Any]:
    qs = Sample.objects.filter(run=run)
    wanted = parse_step(step)
    if wanted == "latest":
        wanted = qs.aggregate(latest=Max("step"))["latest"]
        if wanted is None:
            return {"total": 0, "limit": limit, "offset": offset, "step": None, "items": []}
    if wanted is not None:
        qs = qs.filter(step=wanted)
    if q:
        qs = qs.filter(Q(prompt__icontains=q) | Q(completion__icontains=q))
    total = qs.count()
    items = [
        {"id": s.pk, "step": s.step, "seq": s.seq, "index": s.index, **s.item()}
        for s in qs.order_by(*SAMPLE_SORTS[sort])[offset : offset + limit]
    ]
    return {"total": total, "limit": limit, "offset": offset, "step": wanted, "items": items}


def sample_steps(run: Run) -> list[dict[str, Any]]:
    return [
        {"step": step, "count": count}
        for step, count in Sample.objects.filter(run=run)
        .values("step")
        .annotate(count=Count("id"))
        .order_by("step")
        .values_list("step", "count")
    ]


# --- share links -----------------------------------------------------------------------------


def share_out(link: ShareLink) -> dict[str, Any]:
    return {
        "id": link.pk,
        "run_id": link.run_id,
        "token": link.token,
        "path": f"/share/{link.token}/",
        "api_path": f"/api/shared/{link.token}",
        "created_by": link.created_by.get_username() if link.created_by else None,
        "created_at": link.created_at,
        "revoked_at": link.revoked_at,
        "active": link.revoked_at is None,
    }


def workers_out(user: Any) -> list[dict[str, Any]]:
    """The online workers (``webapp.runs.routing.live_workers``) for ``user``: every worker, but
    only the held runs of the user's own teams by name (others count, unnamed)."""
    from webapp.runs.routing import live_workers

    workers = live_workers()
    held = {int(r) for w in workers for r in w.running if str(r).isdigit()}
    visible = {
        run.pk: run
        for run in Run.objects.filter(pk__in=held, project__team__memberships__user=user).only(
            "id", "name", "status"
        )
    }
    out = []
    for w in workers:
        caps = w.capabilities
        out.append(
            {
                "name": caps.name, "host": caps.host, "queues": caps.queues, "concurrency": caps.concurrency,
                "cpus": caps.cpus, "memory_gb": caps.memory_gb, "backends": caps.backends, "platform": caps.platform,
                "gpus": [
                    {"index": g.index, "name": g.name, "memory_gb": g.memory_gb, "busy": g.index in w.gpus_busy}
                    for g in caps.gpus
                ],
                "running": len(w.running),
                "runs": [
                    {"id": r.pk, "name": r.name, "status": r.status}
                    for r in (visible.get(int(x)) for x in w.running if str(x).isdigit())
                    if r is not None
                ],
                "started_at": datetime.fromtimestamp(w.started_at, UTC),
                "seen_at": datetime.fromtimestamp(w.seen_at, UTC),
            }
        )  # fmt: skip
    return out
