"""The three sockets of the web app.

- ``IngestConsumer`` (``/ws/ingest/<run>/``, ``Authorization: Bearer <token>``): a worker ships one run's engine events
  (protocol in ``client/tributary/protocol.py``). Events are stored and committed, acknowledged,
  then fanned out (``webapp.live.announce``).
- ``RunConsumer`` (``/ws/runs/<run>/?after_seq=N[&share=T]``): a browser follows one run:
  stored events after N are replayed, then live ones follow, with no gap and no duplicate.
  Every ``events`` message carries ``last_seq``, the cursor to reconnect with.
- ``ProjectConsumer`` (``/ws/projects/<project>/``): status changes of a project's runs.

Channel layers drop messages for a consumer that falls behind; every fan-out message says
which seqs it carries (``from_seq``..``last_seq``), so a run consumer that sees a hole reads
the missing events from the database before forwarding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.utils import timezone

from engine.contracts import (
    CLOSE_BAD_EVENT,
    CLOSE_BAD_MESSAGE,
    CLOSE_BAD_TOKEN,
    CLOSE_NO_RUN,
    CLOSE_NOT_FOUND,
    CLOSE_REVOKED,
    CLOSE_TOO_BIG,
    CLOSE_UNAVAILABLE,
)
from tributary.events import clean_text
from tributary.protocol import (
    ATTACH_CLAIM,
    ATTACH_ENGINE_FROM,
    CLAIM_MAX_CHARS,
    HELLO_CLAIMS,
    HELLO_OUTPUT_OFFSET,
    HELLO_OUTPUT_STREAM,
    MAX_BATCH_EVENTS,
    MAX_MESSAGE_BYTES,
    MSG_CLAIM,
)
from webapp.inputs import BIGINT_MAX, INT_MAX
from webapp.live.announce import batch_stored, status_message
from webapp.live.groups import ingest_group, project_group, run_group, share_group, user_group
from webapp.live.replay import stored_events
from webapp.runs.choices import RunStatus
from webapp.runs.external import attach_script
from webapp.runs.ingest import (
    MAX_BIGINT,
    InvalidEvent,
    Prepared,
    SeqGap,
    Stored,
    Turn,
    is_poison,
    prepare,
    stale_attempt_reason,
    store_validated,
    validated,
)
from webapp.runs.models import Run, ShareLink
from webapp.runs.output import OutputRefused, decode_chunk, store_output
from webapp.runs.services import claim_run, note_worker_seen
from webapp.runs.tokens import TokenRejected, check_ingest_token, ingest_token
from webapp.teams.access import NotFound, project_for, run_for

log = logging.getLogger(__name__)

HEARTBEAT_WRITE_EVERY_S = 5.0
MAX_SHARE_TOKEN = 64  # ShareLink.token's length


def _query(scope: dict[str, Any]) -> dict[str, str]:
    raw = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return {key: values[-1] for key, values in raw.items()}


def _route_id(scope: dict[str, Any], name: str) -> int | None:
    """The route's integer id, or None when no row can have it (beyond bigint)."""
    value = int(scope["url_route"]["kwargs"][name])
    return value if 0 < value <= MAX_BIGINT else None


def _close_reason(message: str) -> str:
    """A close frame's reason: at most 123 bytes of UTF-8 (RFC 6455), so no lone surrogate
    and no multi-byte character cut in half."""
    return clean_text(message).encode("utf-8")[:120].decode("utf-8", errors="ignore")


def _bearer(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            kind, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if kind.lower() == "bearer" else ""
    return ""


class _JsonSocket(AsyncWebsocketConsumer):
    closed = False

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Channels' dispatch without its hop to the database thread before every message
        (``aclose_old_connections``). On an ingest socket that thread may be busy storing a
        batch, and the hop would hold the next message, and a cancel for the worker, until the
        batch is stored. On the browser sockets it is one hop per socket and event: a run watched
        by 50 pages queued 50 of them behind each other for every event it stored (~10% of the
        web app's CPU in ``bench/ingest.py --latency-only``). Every database call of these
        consumers goes through ``database_sync_to_async``, which closes old connections itself,
        before and after; none uses the async ORM."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def send_message(self, message: dict[str, Any]) -> None:
        if not self.closed:
            await self.send(text_data=json.dumps(message, separators=(",", ":")))

    async def refuse(self, code: int, message: str) -> None:
        """Accept (so the code reaches the client), say why, close with ``code``."""
        if not self.closed:
            if not getattr(self, "accepted", False):
                await self.accept()
            await self.send_message({"type": "error", "code": code, "message": message})
            await self.close(code=code, reason=_close_reason(message))
            self.closed = True

    async def unavailable(self, what: str) -> None:
        """The database failed: close with 1011 (a worker reconnects and resends later)."""
        log.exception("%s failed: the database is unavailable", what)
        if not self.closed:
            if not getattr(self, "accepted", False):
                await self.accept()
            await self.close(code=CLOSE_UNAVAILABLE)
            self.closed = True

    async def accept(self, subprotocol: str | None = None, headers: Any = None) -> None:
        await super().accept(subprotocol, headers)
        self.accepted = True


# --------------------------------------------------------------------------- ingest

STORE_THREADS = 4
"""Threads storing ingest batches, shared by the process's ingest sockets: each holds a database
connection while it stores (the pool, ``DATABASE_POOL_MAX``, is 10 by default)."""
store_threads = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="ingest-store")


def stores_at_once() -> int:
    """Batches an ingest socket stores at once: two on PostgreSQL (``IngestConsumer._pump``), one
    on SQLite, whose writers wait for each other's whole transaction (nothing to overlap)."""
    return 2 if connections[DEFAULT_DB_ALIAS].vendor == "postgresql" else 1


async def store_in_thread(run_id: int, batch: list[dict[str, Any]], **options: Any) -> Stored:
    """``store_validated`` in a thread of ``store_threads`` (not Channels' one database thread,
    which the rest of the process's database calls share: two batches stored at once need two
    threads, each with its own connection). FIFO: a batch that waits for the one before it
    (``ingest.Turn``) holds a thread only after that one got its own."""
    store = database_sync_to_async(store_validated, thread_sensitive=False, executor=store_threads)
    return await store(run_id, batch, **options)


class IngestConsumer(_JsonSocket):
    """The worker's socket for one run. Only the token decides who may ship: no session.

    An external run's script (``webapp.runs.external``) speaks the same protocol: its ``attach``
    records where it reports from and, with a claim, is answered whether it may hold the run
    (another script with the same client_id may: ``attach_script``); cancel,
    ``hello.cancel`` and token renewal work for it as for a worker."""

    external = False  # set at connect: the run is an external one
    claim = ""  # an external run's: the claim its script's attach won (what it ships is checked against it)
    READ_AHEAD = 2  # messages read and decoded ahead of the stores (a shipper keeps three batches out)
    pump: asyncio.Task[None] | None = None  # starts storing what receive() read, in order
    answerer: asyncio.Task[None] | None = None  # answers the stores _pump started, in order

    async def connect(self) -> None:
        """Admit the worker of the run's current attempt (the token is read from the
        ``Authorization`` header only), say what is stored, and renew its token unless the run
        is final: the worker of an ended attempt may drain its tail, never extend it."""
        run_id = _route_id(self.scope, "run_id")
        self.run_id = run_id or int(self.scope["url_route"]["kwargs"]["run_id"])
        try:
            self.attempt = check_ingest_token(_bearer(self.scope), self.run_id)
        except TokenRejected as exc:
            await self.refuse(exc.code, str(exc))
            return
        # In the run's group before its row is read: a cancel committed in between is then either
        # in the row the hello is made of or heard as a message, never lost between the two.
        await self.channel_layer.group_add(ingest_group(self.run_id), self.channel_name)
        self.groups.append(ingest_group(self.run_id))
        try:
            run = await database_sync_to_async(note_worker_seen)(run_id) if run_id else None
        except DatabaseError:
            await self.unavailable(f"ingest connect of run {self.run_id}")
            return
        if run is None:
            await self.refuse(CLOSE_NO_RUN, f"run {self.run_id} does not exist")
            return
        if run.attempt != self.attempt:
            await self.refuse(CLOSE_BAD_TOKEN, stale_attempt_reason(self.run_id, self.attempt, run.attempt))
            return
        self.final = RunStatus(run.status).is_final
        self.external = run.is_external
        # The RunAttempt its events are stored under (``prepare``): a resume, which makes the next,
        # also moves ``attempt``, so this socket's token is refused from then on.
        self.attempt_number = run.attempt_number
        self.token_issued = time.monotonic()
        self.last_heartbeat_write = time.monotonic()
        self.inbox: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue(self.READ_AHEAD)
        self.started: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()
        self.storing = asyncio.Semaphore(stores_at_once())
        self.turn: Turn | None = None  # the last batch started (the next waits for it to hold the row)
        self.pump = asyncio.create_task(self._pump())
        self.answerer = asyncio.create_task(self._answer_started())
        await self.accept()
        hello: dict[str, Any] = {
            "type": "hello",
            "last_seq": run.last_seq,
            "status": str(run.status),
            "cancel": run.cancel_requested_at is not None,
            HELLO_CLAIMS: True,
            HELLO_OUTPUT_STREAM: run.output_stream,
            HELLO_OUTPUT_OFFSET: run.output_bytes,
        }
        if not self.final:
            hello["token"] = ingest_token(self.run_id, self.attempt)
        await self.send_message(hello)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """One message from the worker, read while the one before it may still be storing.

        The decoding, the events' validation and what storing them takes that no row of the
        database decides (``ingest.prepare``), all pure Python, are done here, in a thread of their
        own (the event loop goes on serving the run's watchers), and the message is queued for
        ``_pump``, which stores and answers one message at a time in the order they came. So a
        batch is made ready while the one before it is in the database (the storing thread waits
        on PostgreSQL then, not on the GIL), and its ack, fan-out and error answers keep their
        order. The queue holds ``READ_AHEAD`` messages: a worker that sends faster than they are
        stored waits on its socket (TCP's back-pressure)."""
        if self.closed:
            return
        raw = text_data if text_data is not None else bytes_data or b""
        await self.inbox.put(await asyncio.to_thread(self._read, raw))

    def _read(self, raw: str | bytes) -> tuple[str, Any]:
        """What ``_pump`` does with one message: ``(kind, what)``; a refusal is ("refuse", (code, why))."""
        size = len(raw.encode("utf-8", errors="surrogatepass")) if isinstance(raw, str) else len(raw)
        if size > MAX_MESSAGE_BYTES:
            return "refuse", (CLOSE_TOO_BIG, f"message of {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
        try:
            message = json.loads(raw)
        except RecursionError:
            return "refuse", (CLOSE_BAD_MESSAGE, "not JSON this server can read: nested too deeply")
        except ValueError as exc:  # UnicodeDecodeError included
            return "refuse", (CLOSE_BAD_MESSAGE, f"not JSON: {exc}")
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "events":
            events = message.get("events")
            if not isinstance(events, list):
                return "refuse", (CLOSE_BAD_MESSAGE, "'events' must be a list of engine events")
            if len(events) > MAX_BATCH_EVENTS:
                return "refuse", (
                    CLOSE_TOO_BIG,
                    f"{len(events)} events in one message; the limit is {MAX_BATCH_EVENTS}",
                )
            try:
                batch = validated(events)
            except InvalidEvent as exc:
                return "refuse", (CLOSE_BAD_EVENT, str(exc))
            try:
                return kind, (batch, prepare(self.run_id, self.attempt_number, batch))
            except (ValueError, TypeError, OverflowError):  # storing meets it too, and quarantines
                return kind, (batch, None)
        if kind in ("ping", "attach", "output"):
            return kind, message
        shown = clean_text(repr(kind))[:80]
        return "refuse", (
            CLOSE_BAD_MESSAGE,
            f"unknown message type {shown}: send an object with type events, output, ping or attach",
        )

    async def _pump(self) -> None:
        """Start storing the queued batches, and hand them to ``_answer_started`` in order, until
        ``disconnect``'s None.

        On PostgreSQL two batches are stored at once (``stores_at_once``): the second's points are
        copied while the first holds the run's row and commits, on two connections, and the row
        lock keeps the cursor's order (``ingest.Turn``). That puts the second core to work:
        ``bench/ingest.py``'s ratio to COPY went from 0.70 to 0.93 (1.01 with the shipper's three
        batches out; issue 19, ``bench/README.md``). Any other message waits until every batch before it is answered, and is
        answered before the next batch starts: an ``attach`` sets the claim later batches are
        stored under."""
        while (item := await self.inbox.get()) is not None:
            kind, what = item
            if self.closed:
                continue  # refused or gone: what was read after that is not taken
            if kind == "events":
                await self.storing.acquire()  # released once answered
                if self.closed:  # gone while this batch waited for its turn: not started
                    self.storing.release()
                    continue
                self.turn = Turn(self.turn)
                self.started.put_nowait((kind, asyncio.ensure_future(self._store(what, self.turn))))
                continue
            await self.started.join()
            await self._answer_safely(kind, what)
        self.started.put_nowait(None)

    async def _answer_started(self) -> None:
        """Answer the batches ``_pump`` started, in the order they came, until its None."""
        while (item := await self.started.get()) is not None:
            try:
                await self._answer_safely(*item)
            finally:
                self.storing.release()
                self.started.task_done()

    async def _answer_safely(self, kind: str, what: Any) -> None:
        """``_answer``, raising nothing: the loops that call it must go on, to free the batches'
        places (``storing``) and announce what is committed, or the socket's end waits forever."""
        try:
            await self._answer(kind, what)
        except Exception as exc:
            if isinstance(exc, OSError):  # the worker is gone (uvicorn's ClientDisconnected)
                log.info("run %s: the worker left while a %s message was answered: %r", self.run_id, kind, exc)
            else:  # a bug, not the worker's message: 1011, the worker resends later
                log.exception("run %s: answering a %s message failed", self.run_id, kind)
            if not self.closed:
                self.closed = True
                with contextlib.suppress(OSError):  # gone: its close raises as its sends did
                    await self.close(code=CLOSE_UNAVAILABLE)

    async def _answer(self, kind: str, what: Any) -> None:
        try:
            if kind == "events":
                await self._events(what)
            elif kind == "ping":
                await self._heartbeat()
            elif kind == "attach":
                await self._attach(what)
            elif kind == "output":
                await self._output(what)
            else:
                await self.refuse(*what)
        except DatabaseError as exc:
            if not is_poison(exc):
                await self.unavailable(f"ingest of run {self.run_id}")
                return
            log.warning("run %s: a %s message the database cannot take: %s", self.run_id, kind, exc)
            await self.refuse(
                CLOSE_BAD_MESSAGE, f"the {kind} message holds a value the database cannot store: {exc}"
            )

    async def disconnect(self, code: int) -> None:
        """Nothing more is answered; the batches being stored finish (and are announced: they are
        committed), the messages queued behind them are dropped (the worker resends from its last
        ack)."""
        self.closed = True
        if self.pump is None or self.answerer is None:
            return
        while not self.inbox.empty():
            self.inbox.get_nowait()
        self.inbox.put_nowait(None)
        await self.pump
        await self.answerer

    async def _store(self, what: tuple[list[dict[str, Any]], Prepared | None], turn: Turn) -> Stored:
        batch, prepared = what
        return await store_in_thread(
            self.run_id,
            batch,
            attempt=self.attempt,
            claim=self.claim,
            announce_events=False,
            prepared=prepared,
            turn=turn,
        )

    async def _events(self, storing: asyncio.Future[Stored]) -> None:
        """Answer a batch once its store (``_store``, started by ``_pump``) is done."""
        try:
            stored = await storing
        except SeqGap as gap:
            # Not fatal: the ack says what is stored, and the worker resends from there.
            await self.send_message({"type": "ack", "seq": gap.expected - 1, "resend": True})
            return
        except InvalidEvent as exc:
            await self.refuse(CLOSE_BAD_EVENT, str(exc))
            return
        except TokenRejected as exc:  # an older attempt, or the attempt's engine already ended
            await self.refuse(exc.code, str(exc))
            return
        except Run.DoesNotExist:
            await self.refuse(CLOSE_NO_RUN, f"run {self.run_id} does not exist")
            return
        # A DatabaseError (the database is down: close 1011, the worker resends) goes up to
        # receive(); the data errors were already quarantined by store_events.
        self.last_heartbeat_write = time.monotonic()
        self.final = self.final or stored.final
        ack: dict[str, Any] = {"type": "ack", "seq": stored.last_seq}
        if stored.quarantined:
            ack["quarantined"] = list(stored.quarantined)
        if not self.final and time.monotonic() - self.token_issued > settings.INGEST_TOKEN_MAX_AGE / 4:
            ack["token"] = ingest_token(self.run_id, self.attempt)
            self.token_issued = time.monotonic()
        # The batch is committed: the ack first (the worker's next batch waits for it), then the
        # run's watchers, from this loop (no hop from the storing thread, issue 19); announced
        # even when the ack cannot be sent, since the events are stored.
        try:
            await self.send_message(ack)
        finally:
            await batch_stored(stored)

    async def _output(self, message: dict[str, Any]) -> None:
        """A chunk of the engine's output (``webapp.runs.output``): stored, then acked with the
        output cursor, which is also the answer to a chunk after a gap (resend from there)."""
        try:
            stream, offset, data = decode_chunk(
                message.get("stream"), message.get("offset"), message.get("data")
            )
            held = await database_sync_to_async(store_output)(
                self.run_id, self.attempt, stream, offset, data, self.claim
            )
        except OutputRefused as exc:
            await self.refuse(CLOSE_BAD_MESSAGE, str(exc))
            return
        except TokenRejected as exc:
            await self.refuse(exc.code, str(exc))
            return
        except Run.DoesNotExist:
            await self.refuse(CLOSE_NO_RUN, f"run {self.run_id} does not exist")
            return
        except OSError:  # the full log could not be written (a full disk): 1011, the worker resends later
            log.exception("run %s: could not write its full log", self.run_id)
            await self.close(code=CLOSE_UNAVAILABLE)
            self.closed = True
            return
        self.last_heartbeat_write = time.monotonic()
        await self.send_message({"type": "output_ack", "offset": held})

    async def _heartbeat(self) -> None:
        """A ping is liveness of the worker (``worker_seen_at``), not progress of the run: only
        stored events (the engine's heartbeat events included) move ``heartbeat_at``, so a
        worker that keeps pinging a stuck run does not keep it looking alive (sweeper.py)."""
        now = time.monotonic()
        if now - self.last_heartbeat_write < HEARTBEAT_WRITE_EVERY_S:
            return
        self.last_heartbeat_write = now
        await database_sync_to_async(Run.objects.filter(pk=self.run_id).update)(worker_seen_at=timezone.now())

    async def _attach(self, message: dict[str, Any]) -> None:
        host = str(message.get("host") or "")[:255]
        claim = message.get(ATTACH_CLAIM)
        if claim is not None and (not isinstance(claim, str) or not 0 < len(claim) <= CLAIM_MAX_CHARS):
            await self.refuse(
                CLOSE_BAD_MESSAGE, f"attach: 'claim' must be a string of 1 to {CLAIM_MAX_CHARS} characters"
            )
            return
        engine_from = message.get(ATTACH_ENGINE_FROM)
        if engine_from is not None and (
            isinstance(engine_from, bool)
            or not isinstance(engine_from, int)
            or not 0 <= engine_from <= BIGINT_MAX
        ):
            await self.refuse(
                CLOSE_BAD_MESSAGE, f"attach: '{ATTACH_ENGINE_FROM}' must be a seq (an integer >= 0)"
            )
            return
        if self.external:  # the script holds its run (one script at a time), no queue order
            if claim:  # what this socket sends is taken only while this claim holds the run: kept
                self.claim = claim  # when the attach loses, and not dropped by a later claimless one
            pid = message.get("pid")
            valid_pid = isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= INT_MAX
            answer = await database_sync_to_async(attach_script)(
                self.run_id, host, pid if valid_pid else None, claim or ""
            )
            if answer is not None:  # a claim: another script may hold the run (webapp.runs.external)
                won, why = answer
                await self.send_message({"type": MSG_CLAIM, "won": won, "message": why})
            return
        answer = await database_sync_to_async(claim_run)(
            self.run_id, host, claim or "", getattr(self, "attempt", None), engine_from
        )
        if answer is not None:
            won, why = answer
            await self.send_message({"type": MSG_CLAIM, "won": won, "message": why})

    async def ingest_cancel(self, event: dict[str, Any]) -> None:
        await self.send_message({"type": "cancel", "message": event.get("message", "")})


# --------------------------------------------------------------------------- browsers


def _run_for_viewer(user: Any, run_id: int | None, share: str) -> tuple[Run, str]:
    """The run the socket may show, and the group that re-checks it: the share link's, or the
    signed-in user's. A token that cannot be a share link's is no link (not a database query)."""
    if share:
        link = None
        if run_id and len(share) <= MAX_SHARE_TOKEN and "\x00" not in share:
            link = (
                ShareLink.objects.select_related("run__project__team")
                .filter(token=share, revoked_at=None)
                .first()
            )
        if link is None or link.run_id != run_id:
            raise NotFound(f"run {run_id} not found")
        return link.run, share_group(link.pk)
    if run_id is None or getattr(user, "pk", None) is None:
        raise NotFound(f"run {run_id} not found")
    return run_for(user, run_id), user_group(user.pk)


def _may_still_see_run(user: Any, run_id: int, share: str) -> bool:
    try:
        _run_for_viewer(user, run_id, share)
    except NotFound:
        return False
    return True


def _may_still_see_project(user: Any, project_id: int) -> bool:
    try:
        project_for(user, project_id)
    except NotFound:
        return False
    return True


class _Revocable(_JsonSocket):
    """A browser socket that closes with ``CLOSE_REVOKED`` once its access is taken away: a
    revoked share link, a member removed from the team (``announce.access_changed``
    sends ``access.check`` to the share link's or the user's group; the socket asks the
    database again rather than trusting the message, so any change of access is caught)."""

    async def may_still_see(self) -> bool:
        raise NotImplementedError

    async def access_check(self, message: dict[str, Any]) -> None:
        try:
            allowed = await self.may_still_see()
        except DatabaseError:
            await self.unavailable("re-checking a browser socket's access")
            return
        if not allowed:
            await self.refuse(
                CLOSE_REVOKED, f"access revoked: {message.get('why') or 'you may no longer see this'}"
            )


class RunConsumer(_Revocable):
    """A browser following one run: replay after ``after_seq``, then live, no gap, no duplicate.

    The consumer joins the run's group before reading the database, and channel messages are
    handled one at a time after ``connect`` returns, so an event stored during the replay is
    either in the replay or in a later group message: ``cursor`` (the highest seq sent)
    drops the overlap. A group message whose ``from_seq`` is past ``cursor + 1`` means the
    layer dropped messages: the hole is read from the database first.
    """

    async def connect(self) -> None:
        run_id = _route_id(self.scope, "run_id")
        self.run_id = run_id or int(self.scope["url_route"]["kwargs"]["run_id"])
        query = _query(self.scope)
        self.share = query.get("share", "")
        after = query.get("after_seq", "0") or "0"
        if not (after.isascii() and after.isdigit() and int(after) <= MAX_BIGINT):
            await self.refuse(CLOSE_BAD_MESSAGE, "after_seq must be an integer in [0, 2^63)")
            return
        self.cursor = int(after)
        try:
            run, access_group = await database_sync_to_async(_run_for_viewer)(
                self.scope.get("user"), run_id, self.share
            )
            await self.channel_layer.group_add(run_group(self.run_id), self.channel_name)
            self.groups.append(run_group(self.run_id))
            await self.channel_layer.group_add(access_group, self.channel_name)
            self.groups.append(access_group)
            await self.accept()
            await self.send_message({**status_message(run), "type": "hello"})
            await self._catch_up(run.last_seq)
        except NotFound as exc:
            await self.refuse(CLOSE_NOT_FOUND, str(exc))
        except DatabaseError:
            await self.unavailable(f"run socket of run {self.run_id}")

    async def may_still_see(self) -> bool:
        return await database_sync_to_async(_may_still_see_run)(
            self.scope.get("user"), self.run_id, self.share
        )

    async def _catch_up(self, upto_seq: int) -> None:
        if upto_seq <= self.cursor:
            return
        chunks = await database_sync_to_async(
            lambda: list(stored_events(self.run_id, self.cursor, upto_seq))
        )()
        for events in chunks[:-1]:
            await self.send_message({"type": "events", "events": events, "last_seq": events[-1]["seq"]})
        # The last message carries the cursor to reconnect with, even when the tail holds only
        # status and heartbeat events (not stored as rows, so not replayed).
        await self.send_message(
            {"type": "events", "events": chunks[-1] if chunks else [], "last_seq": upto_seq}
        )
        self.cursor = upto_seq

    async def run_events(self, message: dict[str, Any]) -> None:
        if self.closed:
            return
        if message["from_seq"] > self.cursor + 1:
            try:
                await self._catch_up(message["from_seq"] - 1)
            except DatabaseError:
                await self.unavailable(f"catching up run {self.run_id}")
                return
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
        if self.closed:
            return
        if RunStatus(message["status"]).is_final:
            try:
                await self._catch_up(message.get("last_seq", 0))
            except DatabaseError:
                await self.unavailable(f"catching up run {self.run_id}")
                return
        await self.send_message({**message, "type": "status"})

    async def run_output(self, message: dict[str, Any]) -> None:
        """Lines of the engine's output, for the Logs tab: team members only (a share link's
        page has no Logs tab). Best effort: a page that reconnects reads what it missed."""
        if not self.closed and not self.share:
            lines, skipped = message["lines"], message["skipped"]
            await self.send_message({"type": "output", "lines": lines, "skipped": skipped})

    async def run_alert(self, message: dict[str, Any]) -> None:
        """Health alerts that fired on the run (``webapp.alerts.monitor``): a toast and a chart
        mark on open pages. Best effort: the run page lists every alert when it loads."""
        if not self.closed:
            await self.send_message({"type": "alert", "alerts": message["alerts"]})

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Browsers only listen; anything they send is ignored."""


class ProjectConsumer(_Revocable):
    """Status changes of a project's runs, for the runs table."""

    async def connect(self) -> None:
        project_id = _route_id(self.scope, "project_id")
        self.project_id = project_id or 0
        user = self.scope.get("user")
        try:
            if project_id is None or getattr(user, "pk", None) is None:
                raise NotFound(f"project {self.scope['url_route']['kwargs']['project_id']} not found")
            await database_sync_to_async(project_for)(user, project_id)
        except NotFound as exc:
            await self.refuse(CLOSE_NOT_FOUND, str(exc))
            return
        except DatabaseError:
            await self.unavailable(f"project socket of project {project_id}")
            return
        for group in (project_group(project_id), user_group(user.pk)):
            await self.channel_layer.group_add(group, self.channel_name)
            self.groups.append(group)
        await self.accept()

    async def may_still_see(self) -> bool:
        return await database_sync_to_async(_may_still_see_project)(self.scope.get("user"), self.project_id)

    async def run_status(self, message: dict[str, Any]) -> None:
        await self.send_message({**message, "type": "status"})

    async def run_progress(self, message: dict[str, Any]) -> None:
        """A run's step moved (``announce.batch_stored``, at most once a second per run)."""
        await self.send_message({**message, "type": "progress"})

    async def run_alert(self, message: dict[str, Any]) -> None:
        """A run of the project raised health alerts: the runs table marks its row."""
        await self.send_message({"type": "alert", "run": message["run"], "alerts": message["alerts"]})

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """Browsers only listen."""
