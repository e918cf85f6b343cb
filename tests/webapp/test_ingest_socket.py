"""The ingest socket under issue 13: tokens that die with their attempt, the tail of a final
run, quarantine, a database that is down, and fuzzing of every socket's receive path.

Real sockets through ``webapp.asgi.application`` and the configured channel layer (in-memory
on the SQLite pass, Redis on the PostgreSQL pass)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django import db
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import contracts
from tests.webapp.event_builders import T0, a_run_of, metrics, status
from tests.webapp.test_live import TIMEOUT, closed_with, connections, ingest, watch  # noqa: F401 - fixtures
from webapp.asgi import application
from webapp.live.consumers import CLOSE_NOT_FOUND, CLOSE_UNAVAILABLE, IngestConsumer
from webapp.live.groups import ingest_group
from webapp.runs.choices import RunStatus
from webapp.runs.models import LogLine, MetricPoint, Run
from webapp.runs.tokens import ingest_token, start_attempt

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

INGEST_CODES = {contracts.CLOSE_BAD_MESSAGE, contracts.CLOSE_BAD_TOKEN, contracts.CLOSE_WRONG_RUN, contracts.CLOSE_NO_RUN, contracts.CLOSE_RUN_OVER, contracts.CLOSE_TOO_BIG, contracts.CLOSE_BAD_EVENT}


async def _open(run_id: int, token: str) -> tuple[WebsocketCommunicator, dict[str, Any] | None, int | None]:
    """Connect with ``token`` in the header: (socket, hello or None, close code or None)."""
    comm = WebsocketCommunicator(
        application, f"/ws/ingest/{run_id}/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    await comm.connect(timeout=TIMEOUT)
    first = await comm.receive_output(timeout=TIMEOUT)
    if first["type"] == "websocket.close":
        return comm, None, first.get("code")
    message = json.loads(first["text"])
    if message["type"] == "error":
        return comm, None, (await comm.receive_output(timeout=TIMEOUT)).get("code")
    return comm, message, None


# --------------------------------------------------------------------------- tokens


async def test_a_token_dies_with_its_attempt(connections, run) -> None:  # noqa: F811
    """Queueing the run again (a new attempt) refuses the old token at connect, and on the open
    socket of the old attempt at its next batch."""
    old = await sync_to_async(start_attempt)(run.pk)
    comm, hello, _ = await _open(run.pk, old)
    connections.append(comm)
    assert hello is not None
    new = await sync_to_async(start_attempt)(run.pk)

    await comm.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0)]})
    code, message = await closed_with(comm)
    assert code == contracts.CLOSE_BAD_TOKEN and "token is for attempt 1" in message and "(attempt 2)" in message
    late, hello, code = await _open(run.pk, old)
    connections.append(late)
    assert (hello, code) == (None, contracts.CLOSE_BAD_TOKEN)

    current, hello, _ = await _open(run.pk, new)
    connections.append(current)
    await current.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0)]})
    assert (await current.receive_json_from(timeout=TIMEOUT))["seq"] == 1


async def test_a_final_run_drains_its_tail_and_takes_nothing_after(connections, run, settings) -> None:  # noqa: F811
    """The worker ships the last events (the final status among them) and a reconnect still
    gets its hello and acks for resent events, but no renewed token; a forged late metric from
    the same token is refused and not stored."""
    token = await sync_to_async(start_attempt)(run.pk)
    comm, hello, _ = await _open(run.pk, token)
    connections.append(comm)
    assert hello["token"]
    settings.INGEST_TOKEN_MAX_AGE = 0  # every ack of a live run now carries a fresh token
    await comm.send_json_to({"type": "attach", "host": "cpu-1"})
    events = [*a_run_of(2)[:7], status(8, "succeeded", "done")]
    await comm.send_json_to({"type": "events", "events": events[:4]})
    first = await comm.receive_json_from(timeout=TIMEOUT)
    assert first["seq"] == 4 and first.get("token")
    forged_in_batch = metrics(9, 9999, **{"reward/mean": 99.0})
    await comm.send_json_to({"type": "events", "events": [*events[4:], forged_in_batch]})
    last = await comm.receive_json_from(timeout=TIMEOUT)
    assert last == {"type": "ack", "seq": 8}  # the tail is stored; nothing renewed, nothing after
    stored = await sync_to_async(Run.objects.get)(pk=run.pk)
    assert (stored.status, stored.last_seq, stored.final_seq) == (RunStatus.SUCCEEDED, 8, 8)

    settings.INGEST_TOKEN_MAX_AGE = 3600
    again, hello, _ = await _open(run.pk, token)  # the worker reconnects after a lost ack
    connections.append(again)
    assert (hello["status"], hello["last_seq"], "token" in hello) == ("succeeded", 8, False)
    await again.send_json_to({"type": "events", "events": events[6:]})  # a resend of the tail
    assert await again.receive_json_from(timeout=TIMEOUT) == {"type": "ack", "seq": 8}
    await again.send_json_to({"type": "events", "events": [forged_in_batch]})
    code, message = await closed_with(again)
    assert code == contracts.CLOSE_RUN_OVER and "final status was event 8" in message
    assert not await sync_to_async(MetricPoint.objects.filter(run=run, step=9999).exists)()


# --------------------------------------------------------------------------- quarantine


async def test_a_bad_event_is_quarantined_acked_and_shown(connections, ingest, watch, run, member) -> None:  # noqa: F811
    browser = await watch(f"/ws/runs/{run.pk}/", member)
    await browser.receive_json_from(timeout=TIMEOUT)
    comm, _ = await ingest(run.pk)
    bad = {"run": "r", "seq": 2, "type": "metrics", "step": -1, "time": T0, "values": {}}
    await comm.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0), bad, metrics(3, 2, loss=0.5)]})
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "ack", "seq": 3, "quarantined": [2]}
    seen: list[dict[str, Any]] = []
    while not seen or seen[-1]["seq"] < 3:
        message = await browser.receive_json_from(timeout=TIMEOUT)
        seen.extend(message.get("events", []))
    assert [(e["seq"], e["type"]) for e in seen] == [(1, "metrics"), (2, "log"), (3, "metrics")]
    assert seen[1]["level"] == "error" and "event 2 (metrics) was quarantined" in seen[1]["message"]
    assert await sync_to_async(LogLine.objects.filter(run=run, seq=2, level="error").exists)()


@asynccontextmanager
async def _run_row_held(run_id: int) -> AsyncIterator[None]:
    """The run's row locked by a transaction of another thread until the block ends: the ingest's
    ``SELECT ... FOR UPDATE`` waits for it (PostgreSQL)."""
    from django.db import transaction

    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Run.objects.select_for_update().get(pk=run_id)
                locked.set()
                release.wait(60)
        finally:
            db.connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert await sync_to_async(locked.wait)(30)
        yield
    finally:
        release.set()
        await sync_to_async(holder.join)(30)


async def _ingest_waiting_on_the_row(*, terminate: bool = False) -> int:
    """Until a backend of the test database waits on a lock (the ingest, on the held row): how
    many (terminated first, with ``terminate``); 0 after 30 s. Run in a thread of its own, not
    the consumers' (thread-sensitive) one, which is the one waiting."""

    def waiting() -> int:
        call = "pg_terminate_backend(pid)" if terminate else "pid"
        for _ in range(600):
            with db.connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT {call} FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                )
                found = len(cursor.fetchall())
            if found:
                db.connections.close_all()
                return found
            time.sleep(0.05)
        db.connections.close_all()
        return 0

    return await sync_to_async(waiting, thread_sensitive=False)()


@pytest.mark.postgresql
async def test_a_database_that_is_down_closes_1011_and_quarantines_nothing(connections, ingest, run) -> None:  # noqa: F811
    """The ingest's database connection dies mid-batch (its PostgreSQL backend is terminated, as
    in a server restart): the socket closes with 1011 so the worker resends, nothing is
    quarantined, and the resend on a new connection stores the batch.

    To hit the ingest's own connection and no other, the test holds the run's row lock: the
    ingest's ``SELECT ... FOR UPDATE`` waits for it, and the backend seen waiting is the one
    terminated."""
    comm, _ = await ingest(run.pk)
    batch = {"type": "events", "events": [metrics(1, 1, loss=1.0), metrics(2, 2, loss=0.5)]}
    async with _run_row_held(run.pk):
        await comm.send_json_to(batch)
        assert await _ingest_waiting_on_the_row(terminate=True) == 1
        output = await comm.receive_output(timeout=TIMEOUT)
        assert (output["type"], output.get("code")) == ("websocket.close", CLOSE_UNAVAILABLE), output
    assert not await sync_to_async(LogLine.objects.filter(run=run).exists)()
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).last_seq == 0

    retry, hello = await ingest(run.pk)
    assert hello["last_seq"] == 0
    await retry.send_json_to(batch)
    assert (await retry.receive_json_from(timeout=TIMEOUT))["seq"] == 2


# --------------------------------------------------------------------------- reading ahead


async def test_batches_sent_at_once_are_answered_in_order_and_nothing_after_a_refusal_is_taken(
    connections,  # noqa: F811
    ingest,  # noqa: F811
    run,
) -> None:
    """The socket reads a message while the one before it is stored (``IngestConsumer.receive``):
    the answers still come in the order the messages did, a refusal after them included, and a
    batch read after the refused message is not stored."""
    comm, _ = await ingest(run.pk)
    for first in (1, 3, 5):
        await comm.send_json_to({"type": "events", "events": [metrics(first, first), metrics(first + 1, first + 1)]})
    await comm.send_to(text_data="{not json")
    await comm.send_json_to({"type": "events", "events": [metrics(7, 7)]})
    assert [(await comm.receive_json_from(timeout=TIMEOUT))["seq"] for _ in range(3)] == [2, 4, 6]
    code, message = await closed_with(comm)
    assert code == contracts.CLOSE_BAD_MESSAGE and message.startswith("not JSON")
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).last_seq == 6


async def test_a_worker_gone_while_an_ack_is_sent_leaves_the_batches_after_it_answered(
    connections,  # noqa: F811
    ingest,  # noqa: F811
    run,
    monkeypatch,
) -> None:
    """The worker's connection drops as its first ack is sent; under uvicorn every send and close
    raises from then on (``ClientDisconnected``, an OSError). A batch started beside it
    (PostgreSQL: two at once) is still answered, announced to the run's watchers since it is
    committed; one not started yet is not taken (SQLite). And the ping queued behind them does
    not hold the socket's end forever."""
    from webapp.live import consumers

    announced: list[int] = []
    real_announce, real_send, real_close = consumers.batch_stored, IngestConsumer.send, IngestConsumer.close
    gone = False

    async def announce(stored: Any) -> None:
        announced.append(stored.last_seq)
        await real_announce(stored)

    async def send(self: Any, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False) -> None:
        nonlocal gone
        gone = gone or '"ack"' in (text_data or "")
        if gone:
            raise OSError("the worker is gone")
        await real_send(self, text_data, bytes_data, close)

    async def close_socket(self: Any, code: Any = None, reason: Any = None) -> None:
        if gone:
            raise OSError("the worker is gone")
        await real_close(self, code, reason)

    monkeypatch.setattr(consumers, "batch_stored", announce)
    monkeypatch.setattr(IngestConsumer, "send", send)
    monkeypatch.setattr(IngestConsumer, "close", close_socket)
    comm, _ = await ingest(run.pk)
    two_at_once = consumers.stores_at_once() == 2
    # PostgreSQL: the run's row held until both batches are in the database, so that the second
    # is started before the first is answered, whatever the load (SQLite: one at a time).
    async with _run_row_held(run.pk) if two_at_once else contextlib.nullcontext():
        await comm.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0), metrics(2, 2, loss=2.0)]})
        await comm.send_json_to({"type": "events", "events": [metrics(3, 3, loss=3.0)]})
        if two_at_once:
            assert await _backends_holding_a_lock_on(MetricPoint._meta.db_table, "RowExclusiveLock") == 2
    await comm.send_json_to({"type": "ping"})
    deadline = time.monotonic() + TIMEOUT
    while len(announced) < 1 + two_at_once and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.wait_for(comm.disconnect(), TIMEOUT)
    connections.remove(comm)
    assert announced == ([2, 3] if two_at_once else [2])
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).last_seq == announced[-1]


@pytest.mark.postgresql
async def test_a_cancel_reaches_the_worker_while_its_batch_waits_for_the_database(connections, ingest, run) -> None:  # noqa: F811
    """A cancel sent while the worker's batch is being stored is passed on at once, not after the
    batch's ack: the batch waits on the run's row (held here), the cancel comes, then the ack."""
    comm, _ = await ingest(run.pk)
    async with _run_row_held(run.pk):
        await comm.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0)]})
        assert await _ingest_waiting_on_the_row() == 1
        await get_channel_layer().group_send(ingest_group(run.pk), {"type": "ingest.cancel", "message": "stop"})
        assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "cancel", "message": "stop"}
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == 1


@pytest.mark.postgresql
async def test_a_worker_gone_mid_batch_leaves_the_batches_being_stored_stored_and_the_next_to_its_resend(
    connections,  # noqa: F811
    ingest,  # noqa: F811
    run,
) -> None:
    """The worker disconnects while its first batch waits on the database, its second is stored
    beside it (``stores_at_once``: two on PostgreSQL) and its third is read behind them: the
    first two are stored (and committed) when the database answers, the third is not (the
    worker resends it from its last ack), and the socket's end waits for the two."""
    comm, _ = await ingest(run.pk)
    async with _run_row_held(run.pk):
        await comm.send_json_to({"type": "events", "events": [metrics(1, 1), metrics(2, 2)]})
        assert await _ingest_waiting_on_the_row() == 1
        await comm.send_json_to({"type": "events", "events": [metrics(3, 3)]})
        await comm.send_json_to({"type": "events", "events": [metrics(4, 4)]})
        await asyncio.sleep(0.2)  # read behind the first two (an assertion below holds either way)
        gone = asyncio.ensure_future(comm.disconnect())
        await asyncio.sleep(0.2)
        assert not gone.done()  # the socket's end waits for the batches being stored
    await asyncio.wait_for(gone, TIMEOUT)
    connections.remove(comm)
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).last_seq == 3
    retry, hello = await ingest(run.pk)
    assert hello["last_seq"] == 3
    await retry.send_json_to({"type": "events", "events": [metrics(4, 4)]})
    assert (await retry.receive_json_from(timeout=TIMEOUT))["seq"] == 4


@pytest.mark.postgresql
async def test_a_batch_is_copied_while_the_one_before_waits_for_the_row_and_both_land_in_order(
    connections,  # noqa: F811
    ingest,  # noqa: F811
    run,
) -> None:
    """Two batches are in the database at once: while the first waits on the run's row (held
    here), the second has copied its points in a transaction of its own and waits for its turn
    without asking for the row (``ingest.Turn``: only one backend waits on a lock). Released,
    both are stored with every point, and acknowledged in order."""
    comm, _ = await ingest(run.pk)
    async with _run_row_held(run.pk):
        await comm.send_json_to({"type": "events", "events": [metrics(1, 1, loss=1.0), metrics(2, 2, loss=2.0)]})
        assert await _ingest_waiting_on_the_row() == 1
        await comm.send_json_to({"type": "events", "events": [metrics(3, 3, loss=3.0)]})
        assert await _backends_holding_a_lock_on(MetricPoint._meta.db_table, "RowExclusiveLock") == 2
        assert await _ingest_waiting_on_the_row() == 1
    assert [(await comm.receive_json_from(timeout=TIMEOUT))["seq"] for _ in range(2)] == [2, 3]
    points = await sync_to_async(list)(MetricPoint.objects.filter(run=run).order_by("seq").values_list("seq", "value"))
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0)]


async def _backends_holding_a_lock_on(table: str, mode: str) -> int:
    """Until two backends of the test database (not this one) hold ``mode`` on ``table``: how
    many do (what they have when 30 s pass)."""

    def holding() -> int:
        found = 0
        for _ in range(600):
            with db.connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                    "WHERE c.relname = %s AND l.mode = %s AND l.granted AND l.pid <> pg_backend_pid()",
                    [table, mode],
                )
                found = cursor.fetchone()[0]
            if found >= 2:
                break
            time.sleep(0.05)
        db.connections.close_all()
        return found

    return await sync_to_async(holding, thread_sensitive=False)()


async def test_a_fault_of_the_server_closes_1011_and_the_next_connection_works(
    connections,  # noqa: F811
    ingest,  # noqa: F811
    run,
    monkeypatch,
) -> None:
    """An exception the pump does not expect (a bug in storing, here made to happen) is logged
    and closes the socket with 1011, so the worker reconnects and resends; nothing half-stored."""
    import webapp.live.consumers as consumers

    real = consumers.store_validated

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(consumers, "store_validated", broken)
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "events", "events": [metrics(1, 1)]})
    output = await comm.receive_output(timeout=TIMEOUT)
    assert (output["type"], output.get("code")) == ("websocket.close", CLOSE_UNAVAILABLE), output
    monkeypatch.setattr(consumers, "store_validated", real)
    retry, hello = await ingest(run.pk)
    assert hello["last_seq"] == 0
    await retry.send_json_to({"type": "events", "events": [metrics(1, 1)]})
    assert (await retry.receive_json_from(timeout=TIMEOUT))["seq"] == 1


# --------------------------------------------------------------------------- fuzzing

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_event = st.fixed_dictionaries(
    {"seq": st.integers(min_value=-2, max_value=2**64) | _json, "type": st.sampled_from(["status", "metrics", "samples", "checkpoint", "log", "heartbeat"]) | _json},
    optional={
        "state": st.sampled_from(["starting", "running", "succeeded"]) | _json,
        "step": st.integers(min_value=-1, max_value=2**40) | _json,
        "time": st.floats() | _json,
        "values": st.dictionaries(st.text(max_size=6), st.floats() | _json, max_size=3) | _json,
        "items": st.lists(st.dictionaries(st.sampled_from(["prompt", "completion", "reward", "length", "extra"]), _json), max_size=2) | _json,
        "level": st.sampled_from(["info", "error"]) | _json,
        "message": st.text() | _json,
        "path": st.text() | _json,
        "bytes": st.integers() | _json,
    },
)
_message = (
    st.fixed_dictionaries({"type": st.just("events"), "events": st.lists(_event, max_size=4) | _json})
    | st.fixed_dictionaries({"type": st.sampled_from(["ping", "attach", "events", "other"])}, optional={"host": _json, "claim": _json, "pid": _json, "engine_from": _json})
    | _json
)
_fuzz = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


async def _answer_or_protocol_close(comm: WebsocketCommunicator) -> None:
    """After a message: either the socket still answers (an empty batch gets its ack), or it
    was closed with one of the protocol's codes. An exception in the consumer would surface
    here (the communicator re-raises it)."""
    await comm.send_json_to({"type": "events", "events": []})
    while True:
        output = await comm.receive_output(timeout=TIMEOUT)
        if output["type"] == "websocket.close":
            assert output.get("code") in INGEST_CODES, output
            return
        message = json.loads(output["text"])
        if message["type"] == "ack" and not message.get("resend"):
            return


@_fuzz
@given(payload=_message | st.binary(min_size=1, max_size=64).map(lambda b: ("bytes", b)) | st.text(min_size=1, max_size=64).map(lambda t: ("text", t)))
async def test_fuzz_the_ingest_socket(run, payload) -> None:
    token = await sync_to_async(ingest_token)(run.pk)
    comm, hello, code = await _open(run.pk, token)
    try:
        assert hello is not None, code
        if isinstance(payload, tuple) and payload[0] == "bytes":
            await comm.send_to(bytes_data=payload[1])
        elif isinstance(payload, tuple):
            await comm.send_to(text_data=payload[1])
        else:
            await comm.send_to(text_data=json.dumps(payload))
        await _answer_or_protocol_close(comm)
    finally:
        await comm.disconnect()
        await database_sync_to_async(db.connections.close_all)()


@_fuzz
@given(after=st.text(max_size=30), share=st.text(max_size=80), run_id=st.integers(min_value=1, max_value=10**30), message=_json)
async def test_fuzz_the_browser_sockets(run, project, member, after, share, run_id, message) -> None:
    from urllib.parse import urlencode

    from tests.webapp.test_live import ORIGIN, session_cookie_for

    cookie = await sync_to_async(session_cookie_for)(member)
    for path in (
        f"/ws/runs/{run.pk}/?{urlencode({'after_seq': after, 'share': share})}",
        f"/ws/runs/{run_id}/?{urlencode({'share': share})}",
        f"/ws/projects/{run_id}/",
        f"/ws/projects/{project.pk}/",
    ):
        comm = WebsocketCommunicator(application, path, headers=[ORIGIN, cookie])
        try:
            connected, _ = await comm.connect(timeout=TIMEOUT)
            assert connected
            await comm.send_to(text_data=json.dumps(message))  # browsers only listen: ignored
            if path.startswith("/ws/runs/"):
                output = await comm.receive_output(timeout=TIMEOUT)
                if output["type"] != "websocket.close":
                    kind = json.loads(output["text"])["type"]
                    assert kind in ("hello", "error"), output
                    if kind == "error":
                        output = await comm.receive_output(timeout=TIMEOUT)
                if output["type"] == "websocket.close":
                    assert output.get("code") in (contracts.CLOSE_BAD_MESSAGE, CLOSE_NOT_FOUND), output
            else:
                assert await comm.receive_nothing(timeout=0.05) or True
        finally:
            await comm.disconnect()
    await database_sync_to_async(db.connections.close_all)()
