"""What a page says is always true, live (issue 15): a preparing run's phase, a queued run's place
in its queue, and the step of every active run on the landing page.

Through the real ASGI application and the configured channel layer (in-memory on the SQLite pass,
Redis on the PostgreSQL pass), with workers in the deployment's real registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from tests.webapp import test_live, test_placement
from tests.webapp.event_builders import metrics, status
from webapp.api.serializers import run_out
from webapp.live import announce
from webapp.live.throttle import Throttle
from webapp.runs import placement
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
from webapp.runs.services import claim_run

pytestmark = [pytest.mark.django_db(transaction=True)]

# The sockets and the registry as the live and placement tests open them.
connections, ingest, watch, online = (
    test_live.connections,
    test_live.ingest,
    test_live.watch,
    test_placement.online,
)
worker, TIMEOUT = test_placement.worker, test_live.TIMEOUT


async def next_of_run(comm: WebsocketCommunicator, run_id: int, kind: str = "status") -> dict[str, Any]:
    """The next message of type ``kind`` about run ``run_id`` (others are skipped)."""
    while True:
        message = await comm.receive_json_from(timeout=TIMEOUT)
        if message["type"] == kind and message.get("run") == run_id:
            return message


# --------------------------------------------------------------------------- preparing phases


@pytest.mark.asyncio
async def test_each_preparing_phase_becomes_the_status_line_at_once(
    ingest, watch, run, member, project
) -> None:
    table = await watch(f"/ws/projects/{project.pk}/", member)
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "attach", "host": "vm", "claim": "c1"})
    taken = await next_of_run(table, run.pk)
    # The claim ends the wait in words too: no "Waiting for a worker" on a run a worker holds.
    assert (taken["status"], taken["message"]) == ("starting", "worker vm took the run: starting the engine")
    phases = [
        "starting the engine process",
        "building the starter policy for arithmetic (difficulty 1, first use): 180/1500 steps, 31% accuracy",
        "loading the model (1 file, 4.1 MB) on cpu",
    ]
    for seq, words in enumerate(phases, start=1):
        await comm.send_json_to({"type": "events", "events": [status(seq, "starting", words)]})
        said = await next_of_run(table, run.pk)
        assert (said["status"], said["message"]) == ("starting", words)
        stored = await sync_to_async(Run.objects.get)(pk=run.pk)
        assert stored.status_message == words
        assert (await sync_to_async(run_out)(stored, None))["status_message"] == words  # the API agrees
    # The same words again change nothing and announce nothing; the next state moves on.
    await comm.send_json_to(
        {
            "type": "events",
            "events": [status(4, "starting", phases[-1]), status(5, "running", "training on cpu")],
        }
    )
    said = await next_of_run(table, run.pk)
    assert (said["status"], said["message"]) == ("running", "training on cpu")


def test_a_running_runs_words_follow_its_engine_until_the_final_status(run: Run) -> None:
    store_events(run.pk, [status(1, "starting"), status(2, "running", "training on cpu")])
    store_events(run.pk, [status(3, "running", "training on cpu, eval every 10 steps")])
    run.refresh_from_db()
    assert (run.status, run.status_message) == ("running", "training on cpu, eval every 10 steps")
    store_events(run.pk, [status(4, "running"), status(5, "succeeded", "finished 3 steps")])
    run.refresh_from_db()  # no words: the last ones stay; the final status has its own
    assert (run.status, run.status_message) == ("succeeded", "finished 3 steps")


# --------------------------------------------------------------------------- queue position


def test_queue_words() -> None:
    assert [placement.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th",
    ]  # fmt: skip
    assert placement.taken_by("") == "a worker took the run: starting the engine"


def test_a_queued_run_says_its_place_and_what_the_workers_run(
    online: Callable[..., None],
    make_run: Callable[..., Run],
    django_capture_on_commit_callbacks: Any,
) -> None:
    vm = worker("vm", ["cpu"])
    online(vm, worker("gpu-box", ["gpu"], gpus=1))
    first, second, third = (make_run(name=n, status_message="") for n in ("demo-dapo", "next-up", "last"))
    with django_capture_on_commit_callbacks(execute=True):
        assert placement.refresh_all_waiting() == 3
    messages = {r.name: r.status_message for r in Run.objects.all()}
    assert messages == {
        "demo-dapo": "Waiting for a worker: next in queue 'cpu'; worker vm is free.",
        "next-up": "Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead); worker vm is free.",
        "last": "Waiting for a worker: 3rd in queue 'cpu' (2 queued runs ahead); worker vm is free.",
    }
    # The worker takes the first: every run behind it moves up at once, with no refresh of its own.
    with django_capture_on_commit_callbacks(execute=True):
        assert claim_run(first.pk, "vm", "claim-1") == (True, "")
    second.refresh_from_db()
    third.refresh_from_db()
    assert (
        second.status_message
        == f"Waiting for a worker: next in queue 'cpu'; worker vm is running demo-dapo (#{first.pk})."
    )
    assert third.status_message == (
        f"Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead); worker vm is running demo-dapo (#{first.pk})."
    )
    # With no worker serving the queue, and only then, it says that none is.
    Run.objects.filter(pk=third.pk).update(queue="pool-x")
    third.refresh_from_db()
    assert placement.refresh_waiting(third, placement.live_workers())
    assert third.status_message.startswith("Waiting for a worker: no online worker serves queue 'pool-x'")


@pytest.mark.asyncio
async def test_a_queued_runs_page_hears_its_new_place_when_the_run_ahead_finishes(
    ingest,
    watch,
    online: Callable[..., None],
    make_run: Callable[..., Run],
    member: Any,
) -> None:
    await sync_to_async(online)(worker("vm", ["cpu"]))
    ahead = await sync_to_async(make_run)(name="demo-dapo")
    waiting = await sync_to_async(make_run)(name="mine")
    await sync_to_async(placement.refresh_all_waiting)()
    page = await watch(f"/ws/runs/{waiting.pk}/", member)
    hello = await page.receive_json_from(timeout=TIMEOUT)
    assert (
        hello["message"]
        == "Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead); worker vm is free."
    )

    comm, _ = await ingest(ahead.pk)
    await comm.send_json_to({"type": "attach", "host": "vm", "claim": "c1"})
    moved = await next_of_run(page, waiting.pk)
    assert (
        moved["message"]
        == f"Waiting for a worker: next in queue 'cpu'; worker vm is running demo-dapo (#{ahead.pk})."
    )
    await comm.send_json_to(
        {
            "type": "events",
            "events": [status(1, "starting"), status(2, "running"), status(3, "succeeded", "done")],
        }
    )
    freed = await next_of_run(page, waiting.pk)
    assert freed["message"] == "Waiting for a worker: next in queue 'cpu'; worker vm is free."


# --------------------------------------------------------------------------- live steps


@pytest.mark.asyncio
async def test_the_landing_pages_sockets_hear_each_runs_step_at_most_once_a_second(
    ingest, watch, run, member, project
) -> None:
    table = await watch(f"/ws/projects/{project.pk}/", member)
    comm, _ = await ingest(run.pk)
    await comm.send_json_to({"type": "events", "events": [status(1, "starting"), status(2, "running")]})
    await comm.receive_json_from(timeout=TIMEOUT)
    started = time.monotonic()
    seq = 2
    for step in range(1, 41):  # 40 steps in a few tenths of a second, one batch each
        seq += 1
        await comm.send_json_to({"type": "events", "events": [metrics(seq, step, **{"reward/mean": 0.5})]})
        assert (await comm.receive_json_from(timeout=TIMEOUT))["seq"] == seq
    heard: list[tuple[float, int]] = []
    while not heard or heard[-1][1] < 40:
        message = await next_of_run(table, run.pk, "progress")
        heard.append((time.monotonic(), message["last_step"]))
    elapsed = heard[-1][0] - started
    # The last step arrives (held back at most one window), and at most one message per second
    # went out for the run: not one per step.
    assert heard[0][1] >= 1 and len(heard) <= 2 + int(elapsed / announce.STEP_EVERY_S)
    assert [s for _, s in heard] == sorted({s for _, s in heard})


@pytest.mark.asyncio
async def test_the_throttle_sends_the_first_at_once_and_the_latest_when_the_window_closes() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    async def record(group: str, message: dict[str, Any]) -> None:
        sent.append((group, message))

    throttle = Throttle(0.2, record)
    for step in (1, 2, 3):
        await throttle.offer("run-1", step, "g", {"step": step})
    await throttle.offer("run-2", 7, "g", {"step": 7})  # another key has its own window
    assert sent == [("g", {"step": 1}), ("g", {"step": 7})]
    await asyncio.sleep(0.4)
    assert sent[-1] == ("g", {"step": 3}) and len(sent) == 3
    await throttle.offer("run-1", 3, "g", {"step": 3})  # nothing new: nothing sent
    await asyncio.sleep(0.3)
    assert len(sent) == 3


def test_a_resumed_run_says_its_place_in_the_queue(
    online: Callable[..., None],
    make_run: Callable[..., Run],
    member: Any,
    valid_config: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """The resume's own words are waiting words, which the queue's placement replaces."""
    from webapp.runs.choices import RunStatus
    from webapp.runs.models import Checkpoint
    from webapp.runs.services import resume_run

    online(worker("vm", ["cpu"]))
    make_run(name="ahead", status_message="")
    done = make_run(name="done", config=valid_config, status=RunStatus.CANCELLED, last_step=4, last_seq=9, final_seq=9)
    Checkpoint.objects.create(run=done, seq=8, step=4, path="runs/x/checkpoints/step_000004", bytes=1)
    with django_capture_on_commit_callbacks(execute=True):
        resume_run(done, member)
    done.refresh_from_db()
    assert done.status == RunStatus.QUEUED
    assert done.status_message == "Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead); worker vm is free."


def test_a_resumed_run_waits_behind_the_runs_queued_before_its_resume(
    online: Callable[..., None],
    make_run: Callable[..., Run],
    member: Any,
    valid_config: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:
    """Created first, resumed last: its place is by when it was queued again, not created."""
    from webapp.runs.choices import RunStatus
    from webapp.runs.models import Checkpoint
    from webapp.runs.services import resume_run

    online(worker("vm", ["cpu"]))
    done = make_run(name="done", config=valid_config, status=RunStatus.CANCELLED, last_step=4, last_seq=9, final_seq=9)
    Checkpoint.objects.create(run=done, seq=8, step=4, path="runs/x/checkpoints/step_000004", bytes=1)
    waiting = make_run(name="waiting", status_message="")
    with django_capture_on_commit_callbacks(execute=True):
        resume_run(done, member)
    done.refresh_from_db()
    waiting.refresh_from_db()
    assert done.created_at < waiting.created_at and waiting.queued_at < done.queued_at
    view = placement.QueueView.read("cpu", placement.live_workers())
    assert [r.name for r in view.queued] == ["waiting", "done"]
    assert done.status_message.startswith("Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead)")
