"""External runs (issue 17): a run trained by the user's own script, with no worker.

The API creates one (idempotent by ``client_id``, bounded free-form config, the launch role,
archived projects refused) and renews its ingest token; nothing that assumes a worker touches
it (queue placement, the reconciler, the lost-run sweeper, resume, fork); and a script speaking
the ingest protocol over a real socket (``websockets`` against uvicorn serving
``webapp.asgi.application`` in the test's event loop) ships its events, which are stored, and
hears a Cancel from the page, live and on reconnect.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
import uvicorn
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django import db
from django.test import Client
from django.utils import timezone
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from engine.contracts import CLOSE_CLAIM_LOST
from tests.webapp.event_builders import metrics, samples, status
from tributary.protocol import script_claim
from webapp.runs import placement, reconcile
from webapp.runs.choices import RunOrigin, RunStatus
from webapp.runs.external import HOLDER_SILENT_S, MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH
from webapp.runs.models import MetricPoint, Run, RunAttempt, Sample
from webapp.runs.services import request_cancel
from webapp.runs.sweeper import sweep_lost_runs
from webapp.runs.tokens import check_ingest_token
from webapp.teams.models import Project

CONFIG = {"model": "Qwen/Qwen2.5-0.5B", "optim": {"lr": 1e-6, "betas": [0.9, 0.99]}, "my own key": True}
TIMEOUT = 30.0  # only keeps a broken build from hanging: every wait below is for a message


def _create(client: Client, token: str, **body: Any) -> Any:
    payload = {"project": "gsm8k", "name": "my-trl-run", "config": CONFIG, **body}
    return client.post(
        "/api/runs/external",
        json.dumps(payload),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def _locs(response: Any) -> list[list[Any]]:
    return [e["loc"] for e in response.json()["detail"]]


# --------------------------------------------------------------------------- the API


def test_it_creates_an_external_run_waiting_for_its_script(
    member: Any, project: Project, token_for: Any
) -> None:
    response = _create(Client(), token_for(member), tags=["trl", "grpo"], client_id=str(uuid.uuid4()))
    assert response.status_code == 201, response.content
    body = response.json()
    run = Run.objects.get(pk=body["id"])
    assert body["url"] == f"http://testserver/runs/{run.pk}/"
    assert body["ingest_url"] == f"ws://testserver/ws/ingest/{run.pk}/"
    assert check_ingest_token(body["ingest_token"], run.pk) == run.attempt
    # Stored as given: no engine schema filled it in or refused "my own key".
    assert run.config == CONFIG and run.tags == ["trl", "grpo"] and run.project == project
    assert run.origin == RunOrigin.EXTERNAL and run.created_by == member
    assert run.status == RunStatus.QUEUED and run.status_message == placement.EXTERNAL_WAITING
    assert list(RunAttempt.objects.filter(run=run).values_list("number", flat=True)) == [1]
    detail = (
        Client().get(f"/api/runs/{run.pk}", headers={"Authorization": f"Bearer {token_for(member)}"}).json()
    )
    assert detail["origin"] == "external" and detail["config"] == CONFIG
    assert detail["permissions"]["fork"] is False and detail["permissions"]["resume"] is False


def test_the_same_client_id_returns_the_same_run_with_a_fresh_token(
    member: Any, project: Project, team: Any, token_for: Any
) -> None:
    token, client_id = token_for(member), str(uuid.uuid4())
    first = _create(Client(), token, client_id=client_id)
    again = _create(Client(), token, client_id=client_id, name="renamed by a restarted script")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert check_ingest_token(again.json()["ingest_token"], first.json()["id"]) >= 0
    assert Run.objects.get(pk=first.json()["id"]).name == "my-trl-run"  # the run as created
    # Another id, or the same id in another project: another run.
    other = _create(Client(), token, client_id=str(uuid.uuid4()))
    Project.objects.create(team=team, name="MATH", slug="math")
    elsewhere = _create(Client(), token, project="math", client_id=client_id)
    no_id = [_create(Client(), token), _create(Client(), token)]
    ids = {r.json()["id"] for r in (first, other, elsewhere, *no_id)}
    assert len(ids) == 5 and {r.status_code for r in (other, elsewhere, *no_id)} == {201}


def test_who_may_create_one_and_renew_its_token(
    member: Any, viewer: Any, outsider: Any, project: Project, token_for: Any, make_run: Callable[..., Run]
) -> None:
    assert _create(Client(), token_for(viewer)).status_code == 403
    assert _create(Client(), token_for(outsider)).status_code == 404  # another team's project: unknown
    assert Client().post("/api/runs/external", "{}", content_type="application/json").status_code == 401
    run_id = _create(Client(), token_for(member)).json()["id"]

    def renew(user: Any, pk: int) -> Any:
        headers = {"Authorization": f"Bearer {token_for(user)}"}
        return Client().post(f"/api/runs/{pk}/ingest-token", headers=headers)

    fresh = renew(member, run_id)
    assert fresh.status_code == 200 and fresh.json()["ingest_url"] == f"ws://testserver/ws/ingest/{run_id}/"
    assert check_ingest_token(fresh.json()["ingest_token"], run_id) == 1
    assert renew(viewer, run_id).status_code == 403
    assert renew(outsider, run_id).status_code == 404
    engine_run = renew(member, make_run().pk)
    assert engine_run.status_code == 409 and "engine run" in engine_run.json()["detail"]


def test_bad_input_names_the_field(member: Any, team: Any, project: Project, token_for: Any) -> None:
    token = token_for(member)
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"config": [1, 2]}, "config", "must be an object"),
        ({"config": {"a": "x\u0000y"}}, "config", "NUL"),
        ({"client_id": "not-a-uuid"}, "client_id", ""),
        ({"name": "   "}, "name", "blank"),
        ({"tags": ["x" * 51]}, "tags", "1-50"),
        ({"project": ""}, "project", ""),
    ]
    deep: Any = {}
    for _ in range(MAX_CONFIG_DEPTH + 1):
        deep = {"k": deep}
    cases.append(({"config": deep}, "config", f"deeper than {MAX_CONFIG_DEPTH}"))
    cases.append(({"config": {"blob": "x" * MAX_CONFIG_BYTES}}, "config", f"limit is {MAX_CONFIG_BYTES}"))
    for body, field, words in cases:
        response = _create(Client(), token, **body)
        assert response.status_code == 422, (body, response.content)
        assert ["body", "payload", field] in _locs(response), response.content
        assert words in json.dumps(response.json()), response.content
    # A slug in two of the caller's teams: ambiguous, named; "team/slug" picks one.
    from webapp.teams.services import create_team

    second = create_team("Second", member)
    Project.objects.create(team=second, name="GSM8K too", slug="gsm8k")
    ambiguous = _create(Client(), token)
    assert ambiguous.status_code == 422 and _locs(ambiguous) == [["body", "payload", "project"]]
    assert f"{team.slug}/gsm8k" in ambiguous.json()["detail"][0]["msg"]
    assert _create(Client(), token, project=f"{second.slug}/gsm8k").status_code == 201
    assert Run.objects.filter(origin=RunOrigin.EXTERNAL).count() == 1


def test_an_archived_project_refuses_new_external_runs(member: Any, project: Project, token_for: Any) -> None:
    Project.objects.filter(pk=project.pk).update(archived_at=timezone.now())
    response = _create(Client(), token_for(member))
    assert response.status_code == 409 and "archived" in response.json()["detail"]
    assert not Run.objects.exists()


def test_it_cannot_be_resumed_or_forked(member: Any, project: Project, token_for: Any) -> None:
    token = token_for(member)
    run = Run.objects.get(pk=_create(Client(), token).json()["id"])
    run.transition(RunStatus.CANCELLED, message="stopped")
    headers = {"Authorization": f"Bearer {token}"}
    resumed = Client().post(
        f"/api/runs/{run.pk}/resume", "{}", content_type="application/json", headers=headers
    )
    forked = Client().post(f"/api/runs/{run.pk}/fork", "{}", content_type="application/json", headers=headers)
    assert resumed.status_code == 409 and "external run" in resumed.json()["detail"]
    assert forked.status_code == 409 and "external run" in forked.json()["detail"]
    assert Run.objects.count() == 1 and Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


# --------------------------------------------------------------------------- no worker


class _EmptyBroker:
    """A broker that holds no message (one a restart wiped): every queued run is an orphan."""

    exact = True

    def view(self, queues: set[str]) -> reconcile.BrokerView:
        return reconcile.BrokerView()


def _external(project: Project, member: Any, **fields: Any) -> Run:
    fields.setdefault("status_message", placement.EXTERNAL_WAITING)
    return Run.objects.create(
        project=project, created_by=member, name="ext", config=CONFIG, origin=RunOrigin.EXTERNAL, queue="external",
        **fields,
    )  # fmt: skip


def test_the_reconciler_and_the_queue_leave_external_runs_alone(
    member: Any, project: Project, make_run: Callable[..., Run]
) -> None:
    long_ago = timezone.now() - timedelta(hours=1)
    external = _external(project, member, queued_at=long_ago)
    engine = make_run(queued_at=long_ago)
    # Both have no message; only the engine run is sent again.
    assert reconcile.reconcile_queued_runs(broker=_EmptyBroker(), wait=True) == [engine.pk]
    # Queue placement gives the engine run its waiting words and the external run none.
    placement.refresh_all_waiting()
    external.refresh_from_db()
    engine.refresh_from_db()
    assert external.status_message == placement.EXTERNAL_WAITING
    assert engine.status_message.startswith(placement.WAITING)
    assert placement.QueueView.read("external", []).queued == []
    # A script on a worker's machine is none of the worker's runs: the queue's words leave it out.
    from tests.webapp.test_placement import worker

    _external(project, member, status=RunStatus.RUNNING, worker_host="vm", started_at=long_ago)
    busy = make_run(name="on-vm", status=RunStatus.RUNNING, worker_host="vm", started_at=long_ago)
    vm = worker("w1@vm", ["cpu"])
    assert placement.QueueView.read("cpu", [vm]).busy_with(vm) == [busy]


def test_the_sweeper_never_marks_an_external_run_lost(
    member: Any, project: Project, make_run: Callable[..., Run], settings: Any
) -> None:
    """Silent for an hour, starting or running: an engine run is lost; the external run keeps
    its status (its script may be offline, its events waiting on its disk)."""
    silent = timezone.now() - timedelta(hours=1)
    runs = {}
    for origin in (RunOrigin.ENGINE, RunOrigin.EXTERNAL):
        for state in (RunStatus.STARTING, RunStatus.RUNNING):
            fields = {"status": state, "heartbeat_at": silent, "worker_seen_at": silent, "started_at": silent}
            run = make_run(**fields) if origin == RunOrigin.ENGINE else _external(project, member, **fields)
            runs[(origin, state)] = run
    lost = sweep_lost_runs(lost_after=settings.LOST_AFTER)
    assert sorted(lost) == sorted(r.pk for (origin, _), r in runs.items() if origin == RunOrigin.ENGINE)
    for (origin, state), run in runs.items():
        run.refresh_from_db()
        assert run.status == (RunStatus.LOST if origin == RunOrigin.ENGINE else state)


# --------------------------------------------------------------------------- a real socket


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest_asyncio.fixture
async def web() -> AsyncIterator[str]:
    """uvicorn serving the web app in this event loop (its database calls share the test's
    database thread); the base URL. No lifespan: the sweeper is called by the tests."""
    from webapp.asgi import application

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            application,
            host="127.0.0.1",
            port=port,
            lifespan="off",
            log_level="warning",
            ws="websockets-sansio",
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, TIMEOUT)
        await database_sync_to_async(db.connections.close_all)()


async def _api_create(host: str, member: Any, token_for: Any, **body: Any) -> dict[str, Any]:
    token = await sync_to_async(token_for)(member)
    response = await sync_to_async(_create)(Client(HTTP_HOST=host), token, **body)
    assert response.status_code == 201, response.content
    return response.json()


async def _message(ws: ClientConnection, kind: str) -> dict[str, Any]:
    """The next message of type ``kind`` (acks and others before it are skipped)."""
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        if message["type"] == kind:
            return message


@contextlib.asynccontextmanager
async def _script(
    url: str, token: str, host: str = "laptop-3", pid: int = 4242, claim: str | None = None
) -> AsyncIterator[tuple[ClientConnection, dict[str, Any]]]:
    """A script's connection: hello read, attach sent (as ``tributary.shipper`` does); with a
    ``claim``, the web app's answer read too (it must be won)."""
    async with connect(
        url, additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=TIMEOUT
    ) as ws:
        hello = await _message(ws, "hello")
        attach = {"type": "attach", "host": host, "pid": pid}
        await ws.send(json.dumps(attach if claim is None else {**attach, "claim": claim}))
        if claim is not None:
            answer = await _message(ws, "claim")
            assert answer["won"], answer
        yield ws, hello


async def _ship(ws: ClientConnection, events: list[dict[str, Any]]) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "events", "events": events}))
    return await _message(ws, "ack")


async def _run(pk: int) -> Run:
    return await database_sync_to_async(Run.objects.get)(pk=pk)


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_script_ships_its_events_and_hears_a_cancel(
    web: str, member: Any, project: Project, token_for: Any
) -> None:
    created = await _api_create(web, member, token_for, client_id=str(uuid.uuid4()))
    pk = created["id"]
    assert created["ingest_url"] == f"ws://{web}/ws/ingest/{pk}/"
    async with _script(created["ingest_url"], created["ingest_token"]) as (ws, hello):
        assert (hello["status"], hello["last_seq"], hello["cancel"]) == ("queued", 0, False)
        assert await database_sync_to_async(check_ingest_token)(hello["token"], pk) == 1  # renewed at once
        # The attach (handled before the next message): the run is its script's, reporting from
        # its host and pid, until its first status says more.
        assert (await _ship(ws, []))["seq"] == 0
        run = await _run(pk)
        assert (run.status, run.status_message) == (
            RunStatus.STARTING,
            "its script is reporting from laptop-3 (pid 4242)",
        )
        await _ship(ws, [status(1, "running", "training on 1 GPU")])
        run = await _run(pk)
        assert (run.status, run.worker_host, run.client_pid) == (RunStatus.RUNNING, "laptop-3", 4242)
        ack = await _ship(
            ws, [metrics(2, 1, reward=0.25, kl=0.01), samples(3, 1, "1+1", "2+2"), metrics(4, 2, reward=0.5)]
        )
        assert ack["seq"] == 4
        points = await database_sync_to_async(
            lambda: sorted(MetricPoint.objects.filter(run_id=pk).values_list("name", "step", "value"))
        )()
        assert points == [("kl", 1, 0.01), ("reward", 1, 0.25), ("reward", 2, 0.5)]
        assert await database_sync_to_async(Sample.objects.filter(run_id=pk, step=1).count)() == 2

        # Cancel from the page: the connected script is told.
        await database_sync_to_async(request_cancel)(run, "cancelled by bob-member")
        cancel = await _message(ws, "cancel")
        assert cancel["message"] == "cancelled by bob-member"
        assert (await _run(pk)).status == RunStatus.RUNNING  # until the script's own final status

    # A restarted script (another pid) hears it in its hello, and ends the run.
    async with _script(created["ingest_url"], created["ingest_token"], pid=5151) as (ws, hello):
        assert (hello["status"], hello["last_seq"], hello["cancel"]) == ("running", 4, True)
        await _ship(ws, [status(5, "cancelled", "stopped by should_stop()")])
    run = await _run(pk)
    assert (run.status, run.client_pid, run.final_seq) == (RunStatus.CANCELLED, 5151, 5)
    assert run.finished_at is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_cancel_while_queued_reaches_a_script_already_connected(
    web: str, member: Any, project: Project, token_for: Any
) -> None:
    """The script's socket is open (its hello said queued) but its attach not yet handled when
    Cancel is pressed: the run is cancelled at once, as a queued run is, and the connected script
    must hear it and have nothing more stored (seen on a fast machine: a TRL script trained its
    1,000 steps into a run shown as cancelled, every event acked)."""
    created = await _api_create(web, member, token_for)
    pk = created["id"]
    async with connect(
        created["ingest_url"],
        additional_headers={"Authorization": f"Bearer {created['ingest_token']}"},
        open_timeout=TIMEOUT,
    ) as ws:
        hello = await _message(ws, "hello")
        assert (hello["status"], hello["cancel"]) == ("queued", False)
        await database_sync_to_async(request_cancel)(await _run(pk), "cancelled by bob-member")
        assert (await _message(ws, "cancel"))["message"] == "cancelled by bob-member"
        await ws.send(json.dumps({"type": "attach", "host": "laptop-3", "pid": 4242}))
        await ws.send(
            json.dumps({"type": "events", "events": [status(1, "running"), metrics(2, 1, reward=0.5)]})
        )
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), TIMEOUT)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4410
    run = await _run(pk)
    assert (run.status, run.final_seq, run.last_seq) == (RunStatus.CANCELLED, 0, 0)
    assert not await database_sync_to_async(MetricPoint.objects.filter(run_id=pk).exists)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_socket_renews_an_external_runs_token(
    web: str, member: Any, project: Project, token_for: Any, settings: Any
) -> None:
    """An ack carries a fresh token once a quarter of the token's lifetime has passed since the
    last one (``IngestConsumer._events``). The lifetime is cut to 4 s only once the socket is
    open (the connect checks the token with the usual one), so the first ack after 1.1 s has a
    fresh token however slow the machine; it is checked with the usual lifetime again."""
    usual = settings.INGEST_TOKEN_MAX_AGE
    created = await _api_create(web, member, token_for)
    async with _script(created["ingest_url"], created["ingest_token"]) as (ws, _hello):
        assert "token" not in await _ship(ws, [status(1, "running")])
        settings.INGEST_TOKEN_MAX_AGE = 4
        await asyncio.sleep(1.1)
        ack = await _ship(ws, [metrics(2, 1, reward=1.0)])
        settings.INGEST_TOKEN_MAX_AGE = usual
        assert "token" in ack
        assert await database_sync_to_async(check_ingest_token)(ack["token"], created["id"]) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_run_ended_here_refuses_what_its_script_still_sends(
    web: str, member: Any, project: Project, token_for: Any
) -> None:
    """The second cancel ends the run here while its script may still be alive: the script's
    next batch is refused with 4410 (the run is over) and nothing more is stored in it."""
    created = await _api_create(web, member, token_for)
    pk = created["id"]
    async with _script(created["ingest_url"], created["ingest_token"]) as (ws, _hello):
        await _ship(ws, [status(1, "running"), metrics(2, 1, reward=0.5)])
        run = await _run(pk)
        await database_sync_to_async(request_cancel)(run, "first")
        await _message(ws, "cancel")
        await database_sync_to_async(request_cancel)(await _run(pk), "second")
        run = await _run(pk)
        assert (run.status, run.final_seq) == (RunStatus.CANCELLED, 2)
        await ws.send(json.dumps({"type": "events", "events": [metrics(3, 2, reward=9.0)]}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), TIMEOUT)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4410
    steps = await database_sync_to_async(
        lambda: list(MetricPoint.objects.filter(run_id=pk).values_list("step", flat=True))
    )()
    assert steps == [1]


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_script_whose_run_a_copy_took_over_ships_nothing_more(
    web: str, member: Any, project: Project, token_for: Any
) -> None:
    """Its script went silent (cut off, not dead: its sockets still open) and a copy of its
    directory elsewhere took the run over (``webapp.runs.external.hold_run``). Both would number
    their events from the same seq: the first one's next batch, and its next output chunk, are
    refused with ``CLOSE_CLAIM_LOST``, naming where the run is reported from now, and nothing of
    them is stored; the copy ships on."""
    lineage, client_id, token = uuid.uuid4().hex, str(uuid.uuid4()), await sync_to_async(token_for)(member)
    first_claim, copy_claim = script_claim(lineage, "gpu-7", "/runs/a"), script_claim(lineage, "gpu-8", "/runs/a")
    created = await _api_create(web, member, token_for, client_id=client_id, claim=first_claim)
    pk, url = created["id"], created["ingest_url"]
    output = {"type": "output", "stream": "engine.log", "offset": 0, "data": base64.b64encode(b"late\n").decode()}
    async with (
        _script(url, created["ingest_token"], "gpu-7", 100, first_claim) as (events_socket, _),
        _script(url, created["ingest_token"], "gpu-7", 100, first_claim) as (output_socket, _),
    ):
        await _ship(events_socket, [status(1, "running"), metrics(2, 1, reward=0.5)])
        then = timezone.now() - timedelta(seconds=HOLDER_SILENT_S + 1)
        await database_sync_to_async(Run.objects.filter(pk=pk).update)(worker_seen_at=then, heartbeat_at=then)
        body = {"client_id": client_id, "claim": copy_claim, "host": "gpu-8", "pid": 300}
        taken = await sync_to_async(_create)(Client(HTTP_HOST=web), token, **body)
        assert taken.status_code == 200 and taken.json()["id"] == pk, taken.content
        async with _script(url, taken.json()["ingest_token"], "gpu-8", 300, copy_claim) as (copy, copy_hello):
            for ws, message in (
                (events_socket, {"type": "events", "events": [metrics(3, 2, reward=0.0)]}),
                (output_socket, output),
            ):
                await ws.send(json.dumps(message))
                error = await _message(ws, "error")
                assert error["code"] == CLOSE_CLAIM_LOST and "gpu-8 (pid 300)" in error["message"], error
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        await asyncio.wait_for(ws.recv(), TIMEOUT)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_CLAIM_LOST
            # The first script reconnecting loses its attach; should it ship anyway (or attach again
            # without its claim, as a client of before claims would), nothing is taken either.
            async with connect(
                url, additional_headers={"Authorization": f"Bearer {created['ingest_token']}"}, open_timeout=TIMEOUT
            ) as late:
                await _message(late, "hello")
                await late.send(json.dumps({"type": "attach", "host": "gpu-7", "pid": 100, "claim": first_claim}))
                assert not (await _message(late, "claim"))["won"]
                await late.send(json.dumps({"type": "attach", "host": "gpu-7", "pid": 100}))
                await late.send(json.dumps({"type": "events", "events": [metrics(3, 2, reward=0.0)]}))
                assert (await _message(late, "error"))["code"] == CLOSE_CLAIM_LOST
            assert copy_hello["last_seq"] == 2
            assert (await _ship(copy, [metrics(3, 2, reward=1.0)]))["seq"] == 3
    points = await database_sync_to_async(
        lambda: list(MetricPoint.objects.filter(run_id=pk).order_by("step").values_list("step", "value"))
    )()
    assert points == [(1, 0.5), (2, 1.0)]
    run = await _run(pk)
    assert (run.claim, run.output_bytes) == (copy_claim, 0)


def test_the_pages_cancel_words_say_what_happened(
    client_for: Any, member: Any, make_run: Callable[..., Run]
) -> None:
    queued = make_run()
    page = client_for(member).post(f"/runs/{queued.pk}/cancel/", follow=True).content.decode()
    assert "Cancelled before it started." in page and "its script" not in page


def test_the_run_page_says_external_and_offers_no_fork(
    member: Any, project: Project, token_for: Any, client_for: Any
) -> None:
    from django.urls import reverse

    run = Run.objects.get(pk=_create(Client(), token_for(member)).json()["id"])
    page = client_for(member).get(f"/runs/{run.pk}/").content.decode()
    assert "external run · waiting for its script" in page and 'id="run-external-badge"' in page
    assert 'id="fork-link"' not in page and 'id="cancel-button"' in page
    # The launch form's "fork from" of it is refused, not filled with a config the engine cannot read.
    forked = client_for(member).get(reverse("launch-new", args=[project.pk]) + f"?from={run.pk}")
    assert forked.status_code == 404


def test_a_second_cancel_ends_an_external_run_whose_script_is_gone(
    member: Any, project: Project, token_for: Any, make_run: Callable[..., Run]
) -> None:
    """No sweeper marks an external run lost, so a dead script's run would run forever: the
    first cancel asks the script, the second ends the run here. An engine run's second cancel
    changes nothing (its worker, or the sweeper, ends it)."""
    headers = {"Authorization": f"Bearer {token_for(member)}"}
    external = Run.objects.get(pk=_create(Client(), headers["Authorization"].split()[1]).json()["id"])
    engine = make_run()
    for run in (external, engine):
        run.transition(RunStatus.STARTING, worker_host="vm")
        run.transition(RunStatus.RUNNING)
        first = Client().post(f"/api/runs/{run.pk}/cancel", headers=headers).json()
        assert first["status"] == "running" and first["cancel_requested_at"] is not None
        assert first["permissions"]["cancel"] is run.is_external
    second = Client().post(f"/api/runs/{external.pk}/cancel", headers=headers).json()
    assert second["status"] == "cancelled" and "its script did not stop" in second["status_message"]
    assert Client().post(f"/api/runs/{engine.pk}/cancel", headers=headers).json()["status"] == "running"


def test_deleting_an_external_run_asks_no_worker_for_files(
    admin: Any, project: Project, token_for: Any, make_run: Callable[..., Run]
) -> None:
    """Its script's files are on the user's machine: the purge says so, where an engine run's
    goes to its worker's queue."""
    headers = {"Authorization": f"Bearer {token_for(admin)}"}
    external = Run.objects.get(pk=_create(Client(), headers["Authorization"].split()[1]).json()["id"])
    engine = make_run(name="my-engine-run")
    for run in (external, engine):
        run.cancel("cancelled before it started")
    gone = Client().delete(f"/api/runs/{external.pk}?confirm=my-trl-run", headers=headers)
    assert gone.status_code == 200, gone.content
    assert gone.json()["files"] == "none on a worker (an external run)"
    assert not Run.objects.filter(pk=external.pk).exists()
    engine_gone = Client().delete(f"/api/runs/{engine.pk}?confirm=my-engine-run", headers=headers)
    assert engine_gone.json()["files"] in {"removed here", "sent to queue cpu"}


def test_its_script_gets_its_run_back_after_the_project_was_archived(
    member: Any, project: Project, token_for: Any
) -> None:
    token, client_id = token_for(member), str(uuid.uuid4())
    run_id = _create(Client(), token, client_id=client_id).json()["id"]
    Project.objects.filter(pk=project.pk).update(archived_at=timezone.now())
    again = _create(Client(), token, client_id=client_id)
    assert again.status_code == 200 and again.json()["id"] == run_id
    assert _create(Client(), token, client_id=str(uuid.uuid4())).status_code == 409
