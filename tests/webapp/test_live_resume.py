"""A browser socket open on a finished run follows its resume (issue 15): it hears the run queued
again, then the new attempt's events, each saying which attempt logged it, so the page can apply
a rewind as the web app did (``static/tributary/series.js``, ``Attempts``)."""

from __future__ import annotations

from typing import Any

import pytest
from asgiref.sync import sync_to_async

from tests.webapp import test_live
from tests.webapp.event_builders import metrics, status
from tests.webapp.test_api_runs import sent_task
from webapp.runs.ingest import store_events
from webapp.runs.models import Checkpoint, MetricPoint, Run
from webapp.runs.services import resume_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

# The sockets of tests/webapp/test_live.py: a worker's ingest socket and a browser's.
connections, ingest, watch = test_live.connections, test_live.ingest, test_live.watch
TIMEOUT = test_live.TIMEOUT


async def next_of(comm: Any, kind: str) -> dict[str, Any]:
    while True:
        message = await comm.receive_json_from(timeout=TIMEOUT)
        if message["type"] == kind:
            return message


async def test_an_open_page_hears_the_resume_and_the_new_attempts_points(ingest, watch, run, member) -> None:
    first = [status(1, "starting"), status(2, "running")]
    first += [metrics(2 + step, step, reward=float(step)) for step in range(1, 5)]
    first += [status(7, "cancelled", "stopped at step 4")]
    await sync_to_async(store_events)(run.pk, first)
    await sync_to_async(Checkpoint.objects.create)(run=run, seq=100, step=2, path="c/step_000002", bytes=1)
    browser = await watch(f"/ws/runs/{run.pk}/", member)
    assert (await next_of(browser, "hello"))["status"] == "cancelled"
    replayed = await next_of(browser, "events")
    assert [(e["step"], e["attempt"]) for e in replayed["events"]] == [(1, 1), (2, 1), (3, 1), (4, 1)]

    queue = f"live-resume-{run.pk}"
    checkpoint = await sync_to_async(Checkpoint.objects.get)(run=run, step=2)
    await sync_to_async(resume_run)(
        await sync_to_async(Run.objects.get)(pk=run.pk), member, checkpoint, queue=queue
    )
    heard = await next_of(browser, "status")
    assert (heard["status"], heard["last_seq"]) == ("queued", 7)
    kwargs = (await sync_to_async(sent_task)(queue))[1]
    assert (kwargs["run_id"], kwargs["start_seq"], kwargs["resume_path"]) == (run.pk, 7, "c/step_000002")

    worker, hello = await ingest(run.pk, kwargs["token"])
    assert (hello["status"], hello["last_seq"], hello["cancel"]) == ("queued", 7, False)
    await worker.send_json_to({"type": "attach", "host": "gpu-2"})
    second = [
        status(8, "starting"),
        status(9, "running"),
        metrics(10, 3, reward=30.0),
        metrics(11, 4, reward=40.0),
    ]
    await worker.send_json_to({"type": "events", "events": second})
    assert (await worker.receive_json_from(timeout=TIMEOUT))["seq"] == 11
    points = []
    while len(points) < 2:
        message = await next_of(browser, "events")
        points += [
            (e["step"], e["attempt"], e["values"]["reward"])
            for e in message["events"]
            if e["type"] == "metrics"
        ]
    assert points == [(3, 2, 30.0), (4, 2, 40.0)]
    superseded = await sync_to_async(
        lambda: sorted(MetricPoint.objects.filter(run=run, superseded=True).values_list("step", "attempt"))
    )()
    assert superseded == [(3, 1), (4, 1)]
