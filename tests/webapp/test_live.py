"""The three sockets through the real ASGI application (``webapp.asgi.application``) and the
configured channel layer: in-memory on the SQLite pass, Redis on the PostgreSQL pass."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django import db
from django.core import signing
from django.db import transaction
from django.test import Client
from django.utils import timezone

from engine.contracts import (
    CLOSE_BAD_EVENT,
    CLOSE_BAD_MESSAGE,
    CLOSE_BAD_TOKEN,
    CLOSE_NO_RUN,
    CLOSE_TOO_BIG,
    CLOSE_WRONG_RUN,
)
from jobs.registry import registry_from_env
from tests.webapp.conftest import close_store_threads_connections
from tests.webapp.event_builders import a_run_of, metrics, status
from tributary.protocol import MAX_BATCH_EVENTS, MAX_MESSAGE_BYTES
from webapp.asgi import application
from webapp.live import announce
from webapp.live.consumers import CLOSE_NOT_FOUND
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import store_events
from webapp.runs.models import MetricPoint, Run, ShareLink
from webapp.runs.services import create_run, request_cancel
from webapp.runs.sweeper import sweep_lost_runs
from webapp.runs.tokens import ingest_token

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

ORIGIN = (b"origin", b"http://localhost")
TIMEOUT = 10


def session_cookie_for(user: Any) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    return (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())


@pytest_asyncio.fixture
async def connections() -> AsyncIterator[list[WebsocketCommunicator]]:
    opened: list[WebsocketCommunicator] = []
    yield opened
    for comm in opened:
        await comm.disconnect()
    # The consumers' database threads keep their connections (channels.testing makes
    # close_old_connections a no-op): close them, or PostgreSQL refuses to drop the test database
    # at the end. Those of the ingest stores' threads too.
    await database_sync_to_async(db.connections.close_all)()
    await sync_to_async(close_store_threads_connections, thread_sensitive=False)()


@pytest.fixture
def ingest(connections: list[WebsocketCommunicator]) -> Callable[..., Any]:
    async def open_ingest(run_id: int, token: str | None = None) -> tuple[WebsocketCommunicator, dict[str, Any]]:
        token = await sync_to_async(ingest_token)(run_id) if token is None else token
        comm = WebsocketCommunicator(
            application, f"/ws/ingest/{run_id}/", headers=[(b"authorization", f"Bearer {token}".encode())]
        )
        connections.append(comm)
        connected, _ = await comm.connect(timeout=TIMEOUT)
        assert connected
        return comm, await comm.receive_json_from(timeout=TIMEOUT)

    return open_ingest


@pytest.fixture
def watch(connections: list[WebsocketCommunicator]) -> Callable[..., Any]:
    async def open_watch(path: str, user: Any = None) -> WebsocketCommunicator:
        headers = [ORIGIN]
        if user is not None:
            headers.append(await sync_to_async(session_cookie_for)(user))
        comm = WebsocketCommunicator(application, path, headers=headers)
        connections.append(comm)
        connected, _ = await comm.connect(timeout=TIMEOUT)
        assert connected
        return comm

    return open_watch


async def closed_with(comm: WebsocketCommunicator) -> tuple[int, str]:
    """Read until the server closes; return (close code, the error message sent before it)."""
    message = ""
    while True:
        output = await comm.receive_output(timeout=TIMEOUT)
        if output["type"] == "websocket.close":
            return output.get("code"), message
        payload = json.loads(output["text"])
        if payload.get("type") == "error":
            message = payload["message"]


async def received_seqs(comm: WebsocketCommunicator, until_seq: int) -> list[int]:
    """The seqs of the events received until the socket's cursor reaches ``until_seq``."""
    seqs: list[int] = []
    cursor = 0
    while cursor < until_seq:
        message = await comm.receive_json_from(timeout=TIMEOUT)
        if message["type"] == "events":
            seqs.extend(e["seq"] for e in message["events"])
            assert message["last_seq"] >= max(seqs, default=0) and message["last_seq"] > cursor
            cursor = message["last_seq"]
    return seqs


def data_seqs(events: list[dict[str, Any]]) -> list[int]:
    """The seqs a replay can rebuild (status and heartbeat events are not stored as rows)."""
    return [e["seq"] for e in events if e["type"] not in ("status", "heartbeat")]


# --------------------------------------------------------------------------- ingest


async def test_ingest_stores_acks_and_fans_out(ingest, watch, run, member) -> None:
    viewer_socket = await watch(f"/ws/runs/{run.pk}/", member)
    hello = await viewer_socket.receive_json_from(timeout=TIMEOUT)
    assert (hello["type"], hello["status"], hello["last_seq"]) == ("hello", "queued", 0)

    comm, hello = await ingest(run.pk)
    assert (hello["type"], hello["last_seq"], hello["status"], hello["cancel"]) == ("hello", 0, "queued", False)
    signing.TimestampSigner(salt="tributary.ingest").unsign_object(hello["token"])  # a fresh, valid token
    await comm.send_json_to({"type": "attach", "host": "cpu-7", "pid": 1})
    events = a_run_of(3)
    await comm.send_json_to({"type": "events", "events": events[:5]})
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "ack", "seq": 5}
    await comm.send_json_to({"type": "events", "events": events})  # overlaps: duplicates ignored
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "ack", "seq": len(events)}

    assert await received_seqs(viewer_socket, len(events)) == list(range(1, len(events) + 1))
    stored = await sync_to_async(Run.objects.get)(pk=run.pk)
    assert (stored.status, stored.worker_host, stored.last_seq) == (RunStatus.RUNNING, "cpu-7", len(events))
    assert await sync_to_async(MetricPoint.objects.filter(run=run).count)() == 6


@pytest.mark.parametrize(
    ("token", "code", "says"),
    [
        ("", CLOSE_BAD_TOKEN, "no token"),
        ("forged:token", CLOSE_BAD_TOKEN, "not one this web app signed"),
        ("OTHER", CLOSE_WRONG_RUN, "for another run"),
        ("EXPIRED", CLOSE_BAD_TOKEN, "expired"),
    ],
)
async def test_ingest_refuses_bad_tokens(connections, run, make_run, token, code, says, settings) -> None:
    if token == "OTHER":
        token = await sync_to_async(ingest_token)((await sync_to_async(make_run)(name="another")).pk)
    elif token == "EXPIRED":
        token = await sync_to_async(ingest_token)(run.pk)
        settings.INGEST_TOKEN_MAX_AGE = -1
    comm = WebsocketCommunicator(
        application, f"/ws/ingest/{run.pk}/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connections.append(comm)
    await comm.connect(timeout=TIMEOUT)
    assert (got := await closed_with(comm))[0] == code and says in got[1]


async def test_ingest_refuses_a_token_in_the_url(connections, run) -> None:
    """URLs land in access logs: the header is the only way in."""
    token = await sync_to_async(ingest_token)(run.pk)
    comm = WebsocketCommunicator(application, f"/ws/ingest/{run.pk}/?token={token}")
    connections.append(comm)
    await comm.connect(timeout=TIMEOUT)
    code, message = await closed_with(comm)
    assert code == CLOSE_BAD_TOKEN and "send the header Authorization: Bearer" in message


async def test_ingest_refuses_a_run_that_does_not_exist(connections) -> None:
    token = await sync_to_async(ingest_token)(999999)
    comm = WebsocketCommunicator(
        application, "/ws/ingest/999999/", headers=[(b"authorization", f"Bearer {token}".encode())]
    )
    connections.append(comm)
    await comm.connect(timeout=TIMEOUT)
    assert (await closed_with(comm))[0] == CLOSE_NO_RUN


BAD_MESSAGES = [
    ("{not json", CLOSE_BAD_MESSAGE, "not JSON"),
    ("[1, 2]", CLOSE_BAD_MESSAGE, "unknown message type"),
    ('{"type": "shout"}', CLOSE_BAD_MESSAGE, "unknown message type 'shout'"),
    ('{"type": "events", "events": {"seq": 1}}', CLOSE_BAD_MESSAGE, "must be a list"),
    (json.dumps({"type": "events", "events": [{"type": "party"}]}), CLOSE_BAD_EVENT, "field 'seq' must be an integer"),
    (json.dumps({"type": "events", "events": [metrics(1, 1), "x"]}), CLOSE_BAD_EVENT, "must be a JSON object"),
    ("[" * 100_000 + "]" * 100_000, CLOSE_BAD_MESSAGE, "nested too deeply"),
    ('{"type": "ping"' + ', "x": 1' * 3 + ', "type": ["\\ud800\\u0000"]}', CLOSE_BAD_MESSAGE, "unknown message type"),
    (json.dumps({"type": "events", "events": [{}] * (MAX_BATCH_EVENTS + 1)}), CLOSE_TOO_BIG, "events in one message"),
    (json.dumps({"type": "ping", "pad": "x" * MAX_MESSAGE_BYTES}), CLOSE_TOO_BIG, "the limit is"),
    (json.dumps({"type": "attach", "host": "h", "engine_from": -1}), CLOSE_BAD_MESSAGE, "'engine_from' must be a seq"),
    (json.dumps({"type": "attach", "host": "h", "engine_from": "12"}), CLOSE_BAD_MESSAGE, "'engine_from' must be a seq"),
    (json.dumps({"type": "attach", "host": "h", "engine_from": True}), CLOSE_BAD_MESSAGE, "'engine_from' must be a seq"),
    (json.dumps({"type": "attach", "host": "h", "engine_from": 2**63}), CLOSE_BAD_MESSAGE, "'engine_from' must be a seq"),
]


@pytest.mark.parametrize(("text", "code", "says"), BAD_MESSAGES, ids=[f"{c}-{s[:20]}" for _, c, s in BAD_MESSAGES])
async def test_ingest_closes_on_bad_input_and_writes_nothing(ingest, run, text, code, says) -> None:
    comm, _ = await ingest(run.pk)
    await comm.send_to(text_data=text)
    got_code, message = await closed_with(comm)
    assert got_code == code and says in message
    stored = await sync_to_async(Run.objects.get)(pk=run.pk)
    assert (stored.last_seq, await sync_to_async(MetricPoint.objects.filter(run=run).count)()) == (0, 0)


async def test_ingest_asks_for_a_resend_when_a_batch_leaves_a_gap(ingest, run) -> None:
    comm, _ = await ingest(run.pk)
    events = a_run_of(2)
    await comm.send_json_to({"type": "events", "events": events[:2]})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == 2
    await comm.send_json_to({"type": "events", "events": events[4:]})
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "ack", "seq": 2, "resend": True}
    await comm.send_json_to({"type": "events", "events": events[2:]})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == len(events)


async def test_a_cancel_reaches_the_workers_socket_and_the_next_hello(ingest, run) -> None:
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "attach", "host": "cpu-1"})
    await comm.send_json_to({"type": "events", "events": [status(1, "starting"), status(2, "running")]})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == 2
    await sync_to_async(request_cancel)(await sync_to_async(Run.objects.get)(pk=run.pk), "enough")
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "cancel", "message": "enough"}
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).status == RunStatus.RUNNING  # until the engine stops
    await comm.disconnect()
    _, hello = await ingest(run.pk)
    assert (hello["cancel"], hello["last_seq"]) == (True, 2)


async def test_a_run_cancelled_while_queued_says_so_in_hello(ingest, run) -> None:
    await sync_to_async(request_cancel)(run)
    _, hello = await ingest(run.pk)
    assert hello["status"] == "cancelled"


# --------------------------------------------------------------------------- browsers


async def test_a_browser_replays_after_its_cursor_then_follows_live(ingest, watch, run, member) -> None:
    events = a_run_of(10)
    first, rest = events[:20], events[20:]
    await sync_to_async(store_events)(run.pk, first)
    browser = await watch(f"/ws/runs/{run.pk}/?after_seq=7", member)
    assert (await browser.receive_json_from(timeout=TIMEOUT))["last_seq"] == 20
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "events", "events": rest})
    await comm.receive_json_from(timeout=TIMEOUT)
    got = await received_seqs(browser, len(events))
    assert got == data_seqs(events[7:20]) + [e["seq"] for e in rest]


async def test_browsers_get_live_events_while_the_database_thread_is_busy(watch, run, member) -> None:
    """Delivering a stored batch to a watcher needs no database: it must not queue behind
    whatever holds the thread ``database_sync_to_async`` runs on (channels' own dispatch hops
    there before every message; with 50 pages on a run that was 50 hops per event)."""
    browsers = [await watch(f"/ws/runs/{run.pk}/", member) for _ in range(3)]
    for browser in browsers:
        await browser.receive_json_from(timeout=TIMEOUT)
    stored = await sync_to_async(store_events)(run.pk, [metrics(1, 1, loss=0.5)], announce_events=False)
    gate = threading.Event()
    busy = asyncio.ensure_future(sync_to_async(gate.wait)(3 * TIMEOUT))  # the thread-sensitive thread
    try:
        await announce.batch_stored(stored)  # as the ingest socket does, from the event loop
        for browser in browsers:
            message = await browser.receive_json_from(timeout=TIMEOUT)
            assert (message["type"], [e["seq"] for e in message["events"]]) == ("events", [1])
        assert not busy.done()  # delivered while the thread was still held
    finally:
        gate.set()
        assert await busy


async def test_a_browser_fills_a_hole_the_channel_layer_left(watch, run, member, monkeypatch) -> None:
    """The layer dropped the messages for seq 1-9 (never delivered here): the next message it
    does deliver starts at 10, and the consumer reads 1-9 from the database first."""
    browser = await watch(f"/ws/runs/{run.pk}/", member)
    await browser.receive_json_from(timeout=TIMEOUT)
    events = [metrics(seq, seq, loss=seq / 10) for seq in range(1, 13)]
    with monkeypatch.context() as lossy:
        lossy.setattr(announce, "send", lambda group, message: None)  # the layer loses the fan-out
        await sync_to_async(store_events)(run.pk, events[:9])
    await sync_to_async(store_events)(run.pk, events[9:])  # its fan-out arrives: from_seq 10
    got = await received_seqs(browser, 12)
    assert got == list(range(1, 13))
    replayed = [m for m in events[:9]]
    assert [e["seq"] for e in replayed] == got[:9]


async def test_a_share_token_opens_one_run_read_only(watch, connections, run, make_run, member) -> None:
    link = await sync_to_async(ShareLink.create)(run, member)
    browser = await watch(f"/ws/runs/{run.pk}/?share={link.token}")
    assert (await browser.receive_json_from(timeout=TIMEOUT))["type"] == "hello"

    other = await sync_to_async(make_run)(name="other")
    for path in (f"/ws/runs/{other.pk}/?share={link.token}", f"/ws/runs/{run.pk}/?share=nope"):
        comm = await watch(path)
        assert (await closed_with(comm))[0] == CLOSE_NOT_FOUND
    link.revoked_at = timezone.now()
    await sync_to_async(link.save)()
    comm = await watch(f"/ws/runs/{run.pk}/?share={link.token}")
    assert (await closed_with(comm))[0] == CLOSE_NOT_FOUND


@pytest.mark.parametrize("who", ["outsider", "anonymous"])
async def test_outsiders_get_not_found_on_both_browser_sockets(watch, run, project, outsider, who) -> None:
    user = outsider if who == "outsider" else None
    for path in (f"/ws/runs/{run.pk}/", f"/ws/projects/{project.pk}/"):
        comm = await watch(path, user)
        code, message = await closed_with(comm)
        assert code == CLOSE_NOT_FOUND and "not found" in message


async def test_a_socket_without_origin_is_refused_for_browsers(connections, run) -> None:
    comm = WebsocketCommunicator(application, f"/ws/runs/{run.pk}/")
    connections.append(comm)
    connected, _ = await comm.connect(timeout=TIMEOUT)
    assert not connected


async def test_the_project_socket_carries_status_changes(watch, ingest, run, project, viewer) -> None:
    table = await watch(f"/ws/projects/{project.pk}/", viewer)
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "attach", "host": "cpu-3"})
    await comm.send_json_to({"type": "events", "events": [status(1, "starting"), status(2, "running")]})
    seen = [await table.receive_json_from(timeout=TIMEOUT) for _ in range(2)]
    assert [(m["run"], m["status"]) for m in seen] == [(run.pk, "starting"), (run.pk, "running")]
    assert seen[0]["worker_host"] == "cpu-3"


async def test_watchers_hear_of_a_change_once_it_commits_and_never_of_one_rolled_back(
    watch, run, project, member
) -> None:
    """Announcements wait for the commit (``webapp.live.announce``): a cancel whose transaction
    rolls back reaches nobody; the same cancel committed reaches the runs table."""
    table = await watch(f"/ws/projects/{project.pk}/", member)

    def cancel_then_roll_back() -> None:
        with pytest.raises(RuntimeError), transaction.atomic():
            request_cancel(run)
            raise RuntimeError("rolled back")

    await sync_to_async(cancel_then_roll_back)()
    assert await table.receive_nothing(timeout=1)
    assert (await sync_to_async(Run.objects.get)(pk=run.pk)).status == RunStatus.QUEUED
    await sync_to_async(request_cancel)(run)
    message = await table.receive_json_from(timeout=TIMEOUT)
    assert (message["run"], message["status"]) == (run.pk, "cancelled")


async def test_a_new_run_reaches_the_open_runs_table_at_once(watch, project, member, valid_config) -> None:
    """Created and queued: open runs tables and landing pages list it before any worker speaks,
    also when a worker is online to take it (so no waiting message is written to announce it)."""
    from tests.webapp.test_placement import worker

    registry = registry_from_env()
    registry.publish(worker("cpu@live-test", ["cpu"]), ttl=60)
    try:
        table = await watch(f"/ws/projects/{project.pk}/", member)
        run = await sync_to_async(create_run)(project, member, valid_config, name="fresh", queue="cpu")
        message = await table.receive_json_from(timeout=TIMEOUT)
        assert (message["run"], message["status"], message["message"]) == (run.pk, "queued", "")
    finally:
        registry.remove("cpu@live-test")


async def test_the_sweeper_marks_silent_runs_lost_and_says_so(watch, make_run, project, member) -> None:
    silent = await sync_to_async(make_run)(name="silent", status=RunStatus.RUNNING, worker_host="gpu-2")
    alive = await sync_to_async(make_run)(name="alive", status=RunStatus.RUNNING)
    queued = await sync_to_async(make_run)(name="queued")
    now = timezone.now()
    await sync_to_async(Run.objects.filter(pk=silent.pk).update)(heartbeat_at=now - timedelta(seconds=600))
    await sync_to_async(Run.objects.filter(pk=alive.pk).update)(heartbeat_at=now - timedelta(seconds=5))
    table = await watch(f"/ws/projects/{project.pk}/", member)
    assert await sync_to_async(sweep_lost_runs)(lost_after=120) == [silent.pk]
    message = await table.receive_json_from(timeout=TIMEOUT)
    assert (message["run"], message["status"]) == (silent.pk, "lost")
    assert "no word from worker gpu-2" in message["message"]
    statuses = await sync_to_async(lambda: dict(Run.objects.values_list("pk", "status")))()
    assert (statuses[alive.pk], statuses[queued.pk]) == (RunStatus.RUNNING, RunStatus.QUEUED)


async def test_pings_and_reconnects_are_liveness_not_progress(ingest, watch, run, project, member) -> None:
    """A worker that keeps its socket open and pings (or reconnects) while none of the run's
    events get stored does not keep the run alive: the sweeper marks it lost and says the
    worker is connected but the run makes no progress. Stored events are progress."""
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "attach", "host": "gpu-9"})
    await comm.send_json_to({"type": "events", "events": [status(1, "starting"), status(2, "running")]})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == 2
    long_ago = timezone.now() - timedelta(seconds=600)
    await sync_to_async(Run.objects.filter(pk=run.pk).update)(heartbeat_at=long_ago, worker_seen_at=long_ago)

    await comm.send_json_to({"type": "ping"})
    await comm.disconnect()
    again, _ = await ingest(run.pk)  # a reconnect, then another ping, then an empty batch (a sync point)
    await again.send_json_to({"type": "attach", "host": "gpu-9"})
    await again.send_json_to({"type": "ping"})
    await again.send_json_to({"type": "events", "events": []})
    assert (await again.receive_json_from(timeout=TIMEOUT))["seq"] == 2
    seen = await sync_to_async(Run.objects.get)(pk=run.pk)
    assert seen.heartbeat_at == long_ago and seen.worker_seen_at > long_ago

    table = await watch(f"/ws/projects/{project.pk}/", member)
    assert await sync_to_async(sweep_lost_runs)(lost_after=120) == [run.pk]
    message = await table.receive_json_from(timeout=TIMEOUT)
    assert message["status"] == "lost"
    assert "no progress since" in message["message"] and "worker gpu-9 is still connected" in message["message"]

    progressing = await sync_to_async(make_progress_run)(project)
    assert await sync_to_async(sweep_lost_runs)(lost_after=120) == []
    assert (await sync_to_async(Run.objects.get)(pk=progressing)).status == RunStatus.RUNNING


def make_progress_run(project: Any) -> int:
    """A running run whose heartbeat event was just stored."""
    other = Run.objects.create(project=project, name="progressing")
    other.start(worker_host="gpu-1")
    Run.objects.filter(pk=other.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=600))
    store_events(other.pk, [status(1, "running"), {"run": "r", "seq": 2, "type": "heartbeat", "time": 1.7e9}])
    return other.pk


async def test_a_run_whose_engine_is_starting_is_judged_by_its_workers_liveness(make_run) -> None:
    """Claimed, no event yet (the engine process is starting): a live worker keeps it, within a
    bound; a silent worker does not."""
    now = timezone.now()

    def starting(name: str, claimed_ago: float, seen_ago: float | None) -> int:
        run = make_run(name=name, status=RunStatus.STARTING, worker_host="cpu-5")
        Run.objects.filter(pk=run.pk).update(
            heartbeat_at=now - timedelta(seconds=claimed_ago),
            worker_seen_at=None if seen_ago is None else now - timedelta(seconds=seen_ago),
        )
        return run.pk

    preparing = await sync_to_async(starting)("preparing", 30, 3)
    silent = await sync_to_async(starting)("silent", 30, 30)
    never_seen = await sync_to_async(starting)("never-seen", 30, None)
    stuck = await sync_to_async(starting)("stuck", 100, 1)
    lost = await sync_to_async(sweep_lost_runs)(now=now, lost_after=5)
    assert sorted(lost) == sorted([silent, never_seen, stuck])
    messages = await sync_to_async(lambda: dict(Run.objects.values_list("pk", "status_message")))()
    assert "no word from worker cpu-5" in messages[silent] and "no word from worker cpu-5" in messages[never_seen]
    assert "its engine has written no event" in messages[stuck]
    assert (await sync_to_async(Run.objects.get)(pk=preparing)).status == RunStatus.STARTING


async def test_an_alert_reaches_the_run_page_and_the_runs_table_once_stored(ingest, watch, run, project, member) -> None:
    page = await watch(f"/ws/runs/{run.pk}/", member)
    table = await watch(f"/ws/projects/{project.pk}/", member)
    comm, _ = await ingest(run.pk)
    nan_loss = [
        metrics(1, 1, **{"actor/pg_loss": 0.5}),
        metrics(2, 2, **{"actor/pg_loss": None}),  # NaN, sent as null: the non_finite rule fires
    ]
    await comm.send_json_to({"type": "events", "events": nan_loss})
    assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == 2

    async def alert_on(socket: WebsocketCommunicator) -> dict[str, Any]:
        while True:
            message = await socket.receive_json_from(timeout=TIMEOUT)
            if message["type"] == "alert":
                return message

    on_page, on_table = await alert_on(page), await alert_on(table)
    assert [(a["rule"], a["step"], a["metric"]) for a in on_page["alerts"]] == [("non_finite", 2, "actor/pg_loss")]
    assert on_table["run"] == run.pk and on_table["alerts"] == on_page["alerts"]
