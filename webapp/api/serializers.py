"""How the JSON API shows what it reads: dicts in the shapes of ``webapp.api.schemas``, the
CSV download, and the parsing of query parameters the schemas cannot express.

The reads themselves are ``webapp.runs.selectors`` (the pages make them too). The routers check
who may see what (``webapp.teams.access`` or a share token) and then call these, so the team
API and the read-only share API return exactly the same data.
"""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncGenerator, Generator
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import sync_to_async
from django.http import StreamingHttpResponse
from django.urls import reverse
from django.utils.text import slugify
from ninja.errors import ValidationError

from webapp.inputs import INT_MAX, parse_id
from webapp.runs import selectors
from webapp.runs.choices import ACTIVE_STATUSES, FINAL_STATUSES, RunStatus
from webapp.runs.models import Checkpoint, Run, RunAttempt, ShareLink
from webapp.runs.placement import live_workers
from webapp.runs.wording import status_words
from webapp.teams.access import memberships_of
from webapp.teams.choices import Role
from webapp.teams.models import Project, Team


def query_error(param: str, msg: str, kind: str = "value_error") -> ValidationError:
    """A 422 in ninja's own shape, naming a query parameter."""
    return ValidationError([{"type": kind, "loc": ["query", param], "msg": msg}])


def split_names(names: list[str] | None) -> list[str]:
    """``names=a,b`` and ``names=a&names=b`` alike; order kept, duplicates dropped."""
    out: list[str] = []
    for item in names or []:
        for name in item.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


# --- teams and projects ------------------------------------------------------------------


def team_ref(team: Team) -> dict[str, Any]:
    return {"id": team.pk, "name": team.name, "slug": team.slug}


def project_out(
    project: Project, role: Role | str | None, counts: dict[int, dict[str, int]] | None = None
) -> dict[str, Any]:
    if counts is None:
        counts = selectors.run_counts([project.pk])
    return {
        "id": project.pk,
        "team": team_ref(project.team),
        "name": project.name,
        "slug": project.slug,
        "description": project.description,
        "created_at": project.created_at,
        "role": str(role) if role else None,
        "run_counts": counts[project.pk],
        "archived_at": project.archived_at,
    }


# --- runs --------------------------------------------------------------------------------


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
        "attempt": ckpt.attempt,
        "superseded": ckpt.superseded,
        "deleted": ckpt.deleted,
    }


def attempt_out(attempt: RunAttempt) -> dict[str, Any]:
    return {
        "number": attempt.number,
        "queued_at": attempt.queued_at,
        "started_at": attempt.started_at,
        "ended_at": attempt.ended_at,
        "worker_host": attempt.worker_host,
        "from_checkpoint_id": attempt.from_checkpoint_id,
        "from_step": attempt.from_step,
        "first_step": attempt.first_step,
        "status": attempt.status,
        "status_badge": RunStatus(attempt.status).badge if attempt.status else "secondary",
        "message": status_words(attempt.message),
        "first_seq": attempt.first_seq,
        "last_seq": attempt.last_seq,
    }


def run_list_item(run: Run) -> dict[str, Any]:
    return {
        "id": run.pk,
        "name": run.name,
        "project_id": run.project_id,
        "status": run.status,
        "status_badge": run.status_badge,
        "status_message": status_words(run.status_message),  # no worker path or CLI flag
        "created_at": run.created_at,
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "created_by": run.created_by.get_username() if run.created_by else None,
        "queue": run.queue,
        "origin": run.origin,
        "tags": list(run.tags or []),
        "last_step": run.last_step,
        "parent_id": run.parent_id,
        "parent_kind": run.parent_kind,
        "summary": dict(run.summary or {}),
        "archived_at": run.archived_at,
    }


def run_out(run: Run, role: Role | str | None) -> dict[str, Any]:
    """Everything the run page needs; ``role`` is the caller's (None through a share link)."""
    run = selectors.run_with_details(run)
    status = RunStatus(run.status)
    is_member = role is not None and Role(role).at_least(Role.MEMBER)
    children = [
        {"id": c.pk, "name": c.name, "status": c.status, "kind": c.parent_kind}
        for c in selectors.run_children(run)
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
        "client_pid": run.client_pid,
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
        "attempt_number": run.attempt_number,
        "attempts": [attempt_out(a) for a in selectors.run_attempts(run)],
        "checkpoint_count": run.checkpoint_count,
        "role": str(role) if role else None,
        "permissions": {
            "edit": is_member,
            # An external run's second cancel ends it here (its script may be gone: services.request_cancel).
            "cancel": is_member
            and status in ACTIVE_STATUSES
            and (run.cancel_requested_at is None or run.is_external),
            # An external run trains in its script: nothing here can resume or fork it.
            "resume": is_member
            and status in FINAL_STATUSES
            and run.checkpoint_count > 0
            and not run.is_external,
            "fork": is_member and not run.is_external,
            "share": is_member,
        },
    }


def log_page(run: Run, after_seq: int, level: str | None, limit: int) -> dict[str, Any]:
    rows = list(selectors.log_lines(run, after_seq=after_seq, level=level)[: limit + 1])
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "items": [{"seq": r.seq, "level": r.level, "message": r.message, "time": r.time} for r in rows],
        "next_after_seq": rows[-1].seq if rows else after_seq,
        "has_more": has_more,
    }


# --- metrics ---------------------------------------------------------------------------------


def metrics_csv(run: Run, names: list[str], fmt: str, *, asynchronous: bool = False) -> StreamingHttpResponse:
    """The run's metrics as a CSV download (``selectors.metric_csv_rows``), streamed from the
    database with bounded memory.

    Rows come from a database cursor ``CSV_CHUNK_ROWS`` at a time (a server-side cursor on
    PostgreSQL) and leave as pieces of that many rows. Under ASGI (``asynchronous``) the body
    is an async iterator: Django consumes a sync iterator there by reading it whole into a
    list first ("StreamingHttpResponse must consume synchronous iterators in order to serve
    them asynchronously"), which holds the whole file in memory. Under WSGI it stays a sync
    iterator (the async one would be read whole for the opposite reason).
    """
    chunks = _csv_chunks(selectors.metric_csv_rows(run, names, fmt))
    response = StreamingHttpResponse(
        _async_chunks(chunks) if asynchronous else chunks, content_type="text/csv; charset=utf-8"
    )
    filename = f"run-{run.pk}-{slugify(run.name) or 'run'}-metrics{'-long' if fmt == 'long' else ''}.csv"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _csv_chunks(rows: Generator[list[Any], None, None]) -> Generator[str, None, None]:
    """CSV text of ``selectors.CSV_CHUNK_ROWS`` rows at a time. Closing it (a client that went away)
    closes ``rows`` and so the database cursor under them."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    try:
        count = 0
        for row in rows:
            writer.writerow(row)
            count += 1
            if count == selectors.CSV_CHUNK_ROWS:
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


# --- samples -------------------------------------------------------------------------------


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
    wanted = parse_step(step)
    if wanted == "latest":
        wanted = selectors.latest_sample_step(run)
        if wanted is None:
            return {"total": 0, "limit": limit, "offset": offset, "step": None, "items": []}
    qs = selectors.samples(run, q=q, step=wanted)
    total = qs.count()
    items = [
        {"id": s.pk, "step": s.step, "seq": s.seq, "index": s.index, **s.item()}
        for s in qs.order_by(*selectors.SAMPLE_SORTS[sort])[offset : offset + limit]
    ]
    return {"total": total, "limit": limit, "offset": offset, "step": wanted, "items": items}


# --- share links and workers ---------------------------------------------------------------


def share_out(link: ShareLink) -> dict[str, Any]:
    return {
        "id": link.pk,
        "run_id": link.run_id,
        "token": link.token,
        "path": link.get_absolute_url(),
        "api_path": reverse("api:shared_run", kwargs={"token": link.token}),
        "created_by": link.created_by.get_username() if link.created_by else None,
        "created_at": link.created_at,
        "revoked_at": link.revoked_at,
        "active": link.revoked_at is None,
    }


def workers_out(user: Any) -> list[dict[str, Any]]:
    """The online workers (``webapp.runs.placement.live_workers``) for ``user``: every worker, but
    only the held runs of the user's own teams by name (others count, unnamed)."""
    workers = live_workers()
    held = {int(r) for w in workers for r in w.running if str(r).isdigit()}
    visible = {
        run.pk: run
        for run in selectors.runs_visible_to(user).filter(pk__in=held).only("id", "name", "status")
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
