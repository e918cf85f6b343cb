"""The three sockets of the web app.

- ``IngestConsumer`` (``/ws/ingest/<run>/``, ``Authorization: Bearer <token>``): a worker ships one run's engine events
  (protocol in ``jobs/protocol.py``). Events are stored first, acknowledged, then fanned out.
- ``RunConsumer`` (``/ws/runs/<run>/?after_seq=N[&share=T]``): a browser follows one run:
  stored events after N are replayed, then live ones follow, with no gap and no duplicate.
  Every ``events`` message carries ``last_seq``, the cursor to reconnect with.
- ``ProjectConsumer`` (``/ws/projects/<project>/``): status changes of a project's runs.

Channel layers drop messages for a consumer that falls behind; every fan-out message says
which seqs it carries (``from_seq``..``last_seq``), so a run consumer that sees a hole reads
the missing events from the database before forwarding.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError
from django.utils import timezone

from jobs.protocol import (
    CLOSE_BAD_EVENT,
    CLOSE_BAD_MESSAGE,
    CLOSE_NO_RUN,
    CLOSE_TOO_BIG,
    MAX_BATCH_EVENTS,
    MAX_MESSAGE_BYTES,
)
from webapp.live.groups import ingest_group, project_group, run_group, send_async, status_message
from webapp.live.replay import stored_events
from webapp.runs.choices import RunStatus
from webapp.runs.models import InvalidTransition, Run, ShareLink
from webapp.runs.services import InvalidEvent, SeqGap, store_events
from webapp.runs.tokens import TokenRejected, check_ingest_token, ingest_token
from webapp.teams.access import NotFound, project_for, run_for

log = logging.getLogger(__name__)

CLOSE_NOT_FOUND = 4404  # browser sockets: no such run/project, or not yours to see
CLOSE_UNAVAILABLE = 1011  # the database failed: the worker reconnects and resends
HEARTBEAT_WRITE_EVERY_S = 5.0


def _query(scope: dict[str, Any]) -> dict[str, str]:
    raw = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {key: values[-1] for key, values in raw.items()}


def _bearer(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            kind, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if kind.lower() == "bearer" else ""
    return ""


class _JsonSocket(AsyncWebsocketConsumer):
    closed = False

    async def send_message(self, message: dict[str, Any]) -> None:
        if not self.closed:
            await self.send(text_data=json.dumps(message, separators=(",", ":")))

    async def refuse(self, code: int, message: str) -> None:
        """Accept (so the code reaches the client), say why, close with ``code``."""
        if not self.closed:
            if not getattr(self, "accepted", False):
                await self.accept()
            await self.send_message({"type": "error", "code": code, "message": message})
            await self.close(code=code, reason=message[:120])
            self.closed = True

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        await super().accept(subprotocol, headers)
        self.accepted = True


# --------------------------------------------------------------------------- ingest


class IngestConsumer(_JsonSocket):
    """The worker's socket for one run. Only the token decides who may ship: no session."""

    async def connect(self) -> None:
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        try:
            check_ingest_token(_bearer(self.scope) or _query(self.scope).get("token", ""), self.run_id)
        except TokenRejected as exc:
            await self.refuse(exc.code, str(exc))
            return
        run = await database_sync_to_async(Run.objects.filter(pk=self.run_id).first)()
        if run is None:
            await self.refuse(CLOSE_NO_RUN, f"run {self.run_id} does not exist")
            return
        self.token_issued = time.monotonic()
        self.last_heartbeat_write = 0.0
        await self.channel_layer.group_add(ingest_group(self.run_id), self.channel_name)
        self.groups.append(ingest_group(self.run_id))
        await self.accept()
        await self.send_message(
            {
                "type": "hello",
                "last_seq": run.last_seq,
                "status": str(run.status),
                "cancel": run.cancel_requested_at is not None,
                "token": ingest_token(self.run_id),
            }
        )

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.closed:
            return
        raw = text_data if text_data is not None else bytes_data or b""
        size = len(raw.encode("utf-8")) if isinstance(raw, str) else len(raw)
        if size > MAX_MESSAGE_BYTES:
            await self.refuse(CLOSE_TOO_BIG, f"message of {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
            return
        try:
            message = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            await self.refuse(CLOSE_BAD_MESSAGE, f"not JSON: {exc}")
            return
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "events":
            await self._events(message.get("events"))
        elif kind == "ping":
            await self._heartbeat()
        elif kind == "attach":
            await self._attach(message)
        else:
            await self.refuse(
                CLOSE_BAD_MESSAGE, f"unknown message type {kind!r}: send an object with type events, ping or attach"
            )

    async def _events(self, events: Any) -> None:
        if not isinstance(events, list):
            await self.refuse(CLOSE_BAD_MESSAGE, "'events' must be a list of engine events")
            return
        if len(events) > MAX_BATCH_EVENTS:
            await self.refuse(CLOSE_TOO_BIG, f"{len(events)} events in one message; the limit is {MAX_BATCH_EVENTS}")
            return
        try:
            stored = await database_sync_to_async(store_events)(self.run_id, events)
        except SeqGap as gap:
            # Not fatal: the ack says what is stored, and the worker resends from there.
            await self.send_message({"type": "ack", "seq": gap.expected - 1, "resend": True})
            return
        except InvalidEvent as exc:
            await self.refuse(CLOSE_BAD_EVENT, str(exc))
            return
        except Run.DoesNotExist:
            await self.refuse(CLOSE_NO_RUN, f"run {self.run_id} does not exist")
            return
        except DatabaseError:
            log.exception("ingest of run %s failed; the worker will resend", self.run_id)
            await self.close(code=CLOSE_UNAVAILABLE)
            self.closed = True
            return
        self.last_heartbeat_write = time.monotonic()
        ack: dict[str, Any] = {"type": "ack", "seq": stored.last_seq}
        if time.monotonic() - self.token_issued > settings.INGEST_TOKEN_MAX_AGE / 4:
            ack["token"] = ingest_token(self.run_id)
            self.token_issued = time.monotonic()
        await self.send_message(ack)
        if stored.events:
            await send_async(
                run_group(self.run_id),
                {
                    "type": "run.events",
                    "from_seq": stored.previous_seq + 1,
                    "last_seq": stored.last_seq,
                    "events": stored.events,
                },
            )

    async def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat_write < HEARTBEAT_WRITE_EVERY_S:
            return
        self.last_heartbeat_write = now
        await database_sync_to_async(Run.objects.filter(pk=self.run_id).update)(heartbeat_at=timezone.now())

    async def _attach(self, message: dict[str, Any]) -> None:
        host = str(message.get("host") or "")[:255]
        await database_sync_to_async(_claim)(self.run_id, host)

    async def ingest_cancel(self, event: dict[str, Any]) -> None:
        await self.send_message({"type": "cancel", "message": event.get("message", "")})


def _claim(run_id: int, host: str) -> None:
    """A worker attached: a queued run becomes starting on that host (the engine confirms)."""
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return
    if run.status == RunStatus.QUEUED:
        try:
            run.start(worker_host=host)
            return
        except InvalidTransition:  # cancelled meanwhile: the worker learns it from the status
            pass
    Run.objects.filter(pk=run_id).update(worker_host=host, heartbeat_at=timezone.now())


# --------------------------------------------------------------------------- browsers


def _run_for_viewer(user: Any, run_id: int, share: str) -> Run:
    if share:
        run = ShareLink.run_for_token(share)
        if run is None or run.pk != run_id:
            raise NotFound(f"run {run_id} not found")
        return run
    return run_for(user, run_id)


class RunConsumer(_JsonSocket):
    """A browser following one run: replay after ``after_seq``, then live, no gap, no duplicate.

    The consumer joins the run's group before reading the database, and channel messages are
    handled one at a time after ``connect`` returns, so an event stored during the replay is
    either in the replay or in a later group message: ``cursor`` (the highest seq sent)
    drops the overlap. A group message whose ``from_seq`` is past ``cursor + 1`` means the
    layer dropped messages: the hole is read from the database first.
    """

    async def connect(self) -> None:
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        query = _query(self.scope)
        try:
            self.cursor = max(0, int(query.get("after_seq", "0") or 0))
        except ValueError:
            await self.refuse(CLOSE_BAD_MESSAGE, "after_seq must be an integer")
            return
        try:
            run = await database_sync_to_async(_run_for_viewer)(self.scope.get("user"), self.run_id, query.get("share", ""))
        except NotFound as exc:
            await self.refuse(CLOSE_NOT_FOUND, str(exc))
            return
        await self.channel_layer.group_add(run_group(self.run_id), self.channel_name)
        self.groups.append(run_group(self.run_id))
        await self.accept()
        await self.send_message({**status_message(run), "type": "hello"})
        await self._catch_up(run.last_seq)

    async def _catch_up(self, upto_seq: int) -> None:
        if upto_seq <= self.cursor:
            return
        chunks = await database_sync_to_async(lambda: list(stored_events(self.run_id, self.cursor, upto_seq)))()
        for events in chunks[:-1]:
            await self.send_message({"type": "events", "events": events, "last_seq": events[-1]["seq"]})
        # The last message carries the cursor to reconnect with, even when the tail holds only
        # status and heartbeat events (not stored as rows, so not replayed).
        await self.send_message({"type": "events", "events": chunks[-1] if chunks else [], "last_seq": upto_seq})
        self.cursor = upto_seq

    async def run_events(self, message: dict[str, Any]) -> None:
        if message["from_seq"] > self.cursor + 1:
            await self._catch_up(message["from_seq"] - 1)
        if message["last_seq"] <= self.cursor:
            return
        fresh = [e for e in message["events"] if e["seq"] > self.cursor]
        self.cursor = message["last_seq"]
        await self.send_message({"type": "events", "events": fresh, "last_seq": self.cursor})

    async def run_status(self, message: dict[str, Any]) -> None:
        # The end of a run is the moment to notice events the layer dropped at its tail (no
        # later message would reveal the hole). Only then: a status change is announced as its
        # batch commits, before that batch's events message, which would lose its status
        # events (not stored as rows, so not replayable) to a catch-up here.
        if RunStatus(message["status"]).is_final:
            await self._catch_up(message.get("last_seq", 0))
        await self.send_message({**message, "type": "status"})

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Browsers only listen; anything they send is ignored."""


class ProjectConsumer(_JsonSocket):
    """Status changes of a project's runs, for the runs table."""

    async def connect(self) -> None:
        project_id = int(self.scope["url_route"]["kwargs"]["project_id"])
        try:
            await database_sync_to_async(project_for)(self.scope.get("user"), project_id)
        except NotFound as exc:
            await self.refuse(CLOSE_NOT_FOUND, str(exc))
            return
        await self.channel_layer.group_add(project_group(project_id), self.channel_name)
        self.groups.append(project_group(project_id))
        await self.accept()

    async def run_status(self, message: dict[str, Any]) -> None:
        await self.send_message({**message, "type": "status"})

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Browsers only listen."""
