"""Taking access away closes the browser sockets already open, not only new connections
(issue 13, item 5): a revoked share link, a member removed from the team. Real sockets through
the ASGI application and the configured channel layer (in-memory on the SQLite pass, Redis on
the PostgreSQL pass), revocation through the real API endpoint and pages."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from tests.webapp.event_builders import metrics
from tests.webapp.test_live import TIMEOUT, closed_with, connections, ingest, watch  # noqa: F401 - fixtures
from webapp.live.consumers import CLOSE_REVOKED
from webapp.runs.models import ShareLink
from webapp.teams.choices import Role
from webapp.teams.services import set_role

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


async def _hello(comm: WebsocketCommunicator) -> dict[str, Any]:
    message = await comm.receive_json_from(timeout=TIMEOUT)
    assert message["type"] == "hello"
    return message


async def _still_open(ingest: Any, comms: list[WebsocketCommunicator], run_id: int) -> None:  # noqa: F811
    """The sockets are open and live: an event a worker ships now reaches each of them."""
    worker, hello = await ingest(run_id)
    seq = hello["last_seq"] + 1
    await worker.send_json_to({"type": "events", "events": [metrics(seq, seq, loss=0.5)]})
    assert (await worker.receive_json_from(timeout=TIMEOUT))["seq"] == seq
    for comm in comms:
        while True:
            message = await comm.receive_json_from(timeout=TIMEOUT)
            if message["type"] == "events" and message["last_seq"] >= seq:
                break


@pytest.mark.parametrize("through", ["api", "page"])
async def test_revoking_a_share_link_closes_its_open_sockets(
    watch,  # noqa: F811
    ingest,  # noqa: F811
    run,
    member,
    client_for,
    token_for,
    through,
) -> None:
    revoked = await sync_to_async(ShareLink.create)(run, member)
    kept = await sync_to_async(ShareLink.create)(run, member)
    doomed = await watch(f"/ws/runs/{run.pk}/?share={revoked.token}")
    survivor = await watch(f"/ws/runs/{run.pk}/?share={kept.token}")
    own = await watch(f"/ws/runs/{run.pk}/", member)
    for comm in (doomed, survivor, own):
        await _hello(comm)

    if through == "api":
        response = await sync_to_async(client_for().delete)(
            f"/api/runs/{run.pk}/shares/{revoked.pk}", HTTP_AUTHORIZATION=f"Bearer {await sync_to_async(token_for)(member)}"
        )
        assert response.status_code == 204, response.content
    else:
        client = await sync_to_async(client_for)(member)
        response = await sync_to_async(client.post)(f"/runs/{run.pk}/shares/{revoked.pk}/revoke/")
        assert response.status_code == 302, response.content

    code, message = await closed_with(doomed)
    assert code == CLOSE_REVOKED and "access revoked: the share link was revoked" in message
    await _still_open(ingest, [survivor, own], run.pk)
    # And the revoked token opens nothing new either.
    again = await watch(f"/ws/runs/{run.pk}/?share={revoked.token}")
    assert (await closed_with(again))[0] == 4404


async def test_removing_a_member_closes_their_open_sockets(
    watch,  # noqa: F811
    ingest,  # noqa: F811
    run,
    project,
    team,
    member,
    viewer,
    admin,
    client_for,
) -> None:
    run_socket = await watch(f"/ws/runs/{run.pk}/", member)
    await _hello(run_socket)
    table = await watch(f"/ws/projects/{project.pk}/", member)
    other = await watch(f"/ws/runs/{run.pk}/", viewer)
    await _hello(other)

    client = await sync_to_async(client_for)(admin)
    response = await sync_to_async(client.post)(f"/teams/{team.pk}/members/{member.pk}/remove/")
    assert response.status_code == 302, response.content

    for comm in (run_socket, table):
        code, message = await closed_with(comm)
        assert code == CLOSE_REVOKED and "access revoked: you were removed from the team" in message
    await _still_open(ingest, [other], run.pk)


async def test_a_role_change_keeps_the_members_sockets_open(watch, ingest, run, team, member) -> None:  # noqa: F811
    """Only a change that takes access away closes: a member made viewer still sees the run."""
    from webapp.live.announce import access_changed
    from webapp.live.groups import user_group

    socket = await watch(f"/ws/runs/{run.pk}/", member)
    await _hello(socket)
    await sync_to_async(set_role)(team, member, Role.VIEWER)
    await sync_to_async(access_changed)(user_group(member.pk), "your role changed")
    await _still_open(ingest, [socket], run.pk)
