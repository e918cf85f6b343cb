from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction

from engine.events import EventSink
from tests.webapp.event_builders import T0, a_run_of, metrics, sample_item, samples, status
from webapp.runs.choices import RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample
from webapp.runs.services import InvalidEvent, store_events


def ingest_events(run: Run, events: list[dict[str, Any]]) -> int:
    """Store a batch as the ingest socket does; refresh ``run``; return the new cursor."""
    stored = store_events(run.pk, events)
    run.refresh_from_db()
    return stored.last_seq

def stored(run: Run) -> dict[str, Any]:
    """Everything ingest writes for a run, comparable across calls."""
    run = Run.objects.get(pk=run.pk)
    return {
        "run": (run.status, run.last_seq, run.last_step, run.summary),
        "metrics": sorted(MetricPoint.objects.filter(run=run).values_list("name", "step", "value")),
        "samples": sorted(Sample.objects.filter(run=run).values_list("seq", "index", "step", "completion")),
        "checkpoints": list(Checkpoint.objects.filter(run=run).values_list("seq", "step", "path", "bytes")),
        "logs": list(LogLine.objects.filter(run=run).values_list("seq", "level", "message")),
    }


@pytest.fixture
def claimed(run: Run) -> Run:
    """A run a worker has claimed (starting), as it is when its events arrive."""
    run.start(worker_host="cpu-1")
    return run


def test_it_stores_a_whole_run(claimed) -> None:
    events = a_run_of(3)
    assert ingest_events(claimed, events) == len(events) == claimed.last_seq
    got = stored(claimed)
    assert got["run"] == (RunStatus.RUNNING, 11, 3, {"reward/mean": 0.3, "actor/entropy": 1 / 3})
    assert len(got["metrics"]) == 6 and ("reward/mean", 2, 0.2) in got["metrics"]
    assert [s[:3] for s in got["samples"]][:2] == [(4, 0, 1), (4, 1, 1)]
    assert got["checkpoints"] == [(9, 3, "ckpt/3", 1234)]
    assert got["logs"] == [(10, "info", "saved")]
    point = MetricPoint.objects.get(run=claimed, name="reward/mean", step=1)
    assert point.time.timestamp() == T0 + 1


def test_it_stores_the_same_batch_twice_only_once(claimed) -> None:
    events = a_run_of(3)
    ingest_events(claimed, events)
    first = stored(claimed)
    assert ingest_events(claimed, events) == 11
    assert stored(claimed) == first


def test_it_stores_overlapping_batches_once(claimed, run) -> None:
    events = a_run_of(4)
    ingest_events(claimed, events[:6])
    ingest_events(claimed, events[3:10])  # resend after a lost ack, plus new events
    ingest_events(claimed, events[8:])
    whole = stored(claimed)

    other = Run.objects.create(project=run.project, name="reference")
    other.start(worker_host="cpu-2")
    ingest_events(other, events)
    assert stored(other) == whole


def test_it_orders_a_batch_by_seq(claimed) -> None:
    events = a_run_of(3)
    shuffled = events[::-1]
    assert ingest_events(claimed, shuffled) == 11
    # The summary keeps the value of the latest event, not of the last one in the list.
    assert Run.objects.get(pk=claimed.pk).summary["reward/mean"] == 0.3


def test_it_keeps_one_copy_of_an_event_repeated_inside_a_batch(claimed) -> None:
    events = a_run_of(1)
    assert ingest_events(claimed, events + events[2:4]) == len(events)
    assert Sample.objects.filter(run=claimed).count() == 2


def test_it_returns_the_cursor_for_an_empty_or_already_stored_batch(claimed) -> None:
    assert ingest_events(claimed, []) == 0
    ingest_events(claimed, a_run_of(1))
    assert ingest_events(claimed, a_run_of(1)[:2]) == 7


def test_it_refuses_a_gap_and_writes_nothing(claimed) -> None:
    events = a_run_of(3)
    ingest_events(claimed, events[:3])
    before = stored(claimed)
    with pytest.raises(InvalidEvent, match=r"event seq 5: field 'seq' leaves a gap.*resend from seq 4"):
        ingest_events(claimed, events[4:])
    assert stored(claimed) == before


BAD_EVENTS = [
    ({"seq": 3, "type": "telemetry"}, "event seq 3: field 'type' is 'telemetry'; known types"),
    ({"seq": 3}, "event seq 3: field 'type' is None"),
    ({"seq": 0, "type": "heartbeat", "time": T0}, "field 'seq' must be an integer >= 1"),
    ({"seq": "3", "type": "heartbeat", "time": T0}, "field 'seq' must be an integer >= 1"),
    ({"seq": 3, "type": "metrics", "time": T0, "values": {}}, "event seq 3: field 'step' is missing"),
    ({"seq": 3, "type": "metrics", "step": True, "time": T0, "values": {}}, "field 'step' must be an integer"),
    ({"seq": 3, "type": "metrics", "step": -1, "time": T0, "values": {}}, "field 'step' must be an integer"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": math.nan}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": math.inf}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": "0.1"}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": [1.0]}, "field 'values' must be an object"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": math.nan, "values": {}}, "field 'time' must be a finite number"),
    ({"seq": 3, "type": "samples", "step": 1}, "field 'items' is missing"),
    ({"seq": 3, "type": "samples", "step": 1, "items": [{"prompt": "p"}]}, r"field 'items\[0\].completion' is missing"),
    ({"seq": 3, "type": "samples", "step": 1, "items": [{**sample_item("x"), "reward": math.inf}]}, r"field 'items\[0\].reward' must be a finite"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "path": "c", "bytes": -5}, "field 'bytes' must be an integer >= 0"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "bytes": 5}, "field 'path' is missing"),
    ({"seq": 3, "type": "log", "level": "shout", "message": "x"}, "field 'level' is 'shout'; known levels"),
    ({"seq": 3, "type": "status", "state": "paused"}, "field 'state' is 'paused'; known states"),
    ({"seq": 3, "type": "heartbeat"}, "field 'time' is missing"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "message"), BAD_EVENTS, ids=[m.split(":")[-1][:40] for _, m in BAD_EVENTS])
def test_it_refuses_a_batch_with_a_bad_event_and_writes_nothing(claimed, bad, message) -> None:
    good = a_run_of(1)[:2]
    before = stored(claimed)
    later = metrics(4, 2, **{"reward/mean": 1.0})
    with pytest.raises(InvalidEvent, match=message):
        ingest_events(claimed, [*good, bad, later])
    assert stored(claimed) == before
    assert isinstance(InvalidEvent(1, "f", "x"), ValueError)


def test_it_refuses_a_batch_item_that_is_not_an_object(claimed) -> None:
    with pytest.raises(InvalidEvent, match=r"event seq \? \(item 1\): field 'event' must be a JSON object"):
        ingest_events(claimed, [status(1, "starting"), "oops"])  # type: ignore[list-item]


def test_it_skips_metric_values_the_engine_sent_as_null(claimed) -> None:
    # The engine writes a non-finite metric as null (JSON has no NaN); there is no point to plot.
    ingest_events(claimed, [metrics(1, 1, **{"actor/kl": None, "reward/mean": 0.5})])
    assert list(MetricPoint.objects.filter(run=claimed).values_list("name", flat=True)) == ["reward/mean"]
    assert Run.objects.get(pk=claimed.pk).summary == {"reward/mean": 0.5}


def test_it_walks_the_state_machine_from_status_events(claimed) -> None:
    ingest_events(claimed, [status(1, "starting"), status(2, "running"), status(3, "running")])
    assert Run.objects.get(pk=claimed.pk).status == RunStatus.RUNNING
    ingest_events(claimed, [status(4, "succeeded", "done")])
    done = Run.objects.get(pk=claimed.pk)
    assert (done.status, done.status_message, done.last_seq) == (RunStatus.SUCCEEDED, "done", 4)
    assert done.finished_at is not None
    assert not LogLine.objects.filter(run=claimed).exists()


def test_it_keeps_a_refused_status_as_a_warning_and_stores_the_rest(claimed) -> None:
    claimed.cancel("cancelled by bob")
    ingest_events(claimed, [status(1, "starting"), status(2, "running"), metrics(3, 1, loss=0.25)])
    after = Run.objects.get(pk=claimed.pk)
    assert (after.status, after.status_message, after.last_seq) == (
        RunStatus.CANCELLED,
        "cancelled by bob",
        3,
    )
    assert list(LogLine.objects.filter(run=claimed).values_list("seq", "level")) == [
        (1, "warning"),
        (2, "warning"),
    ]
    assert (
        "status 'running' from the engine not applied: the run is 'cancelled'"
        in LogLine.objects.get(seq=2).message
    )
    assert MetricPoint.objects.filter(run=claimed).count() == 1


def test_it_stores_what_the_engine_writes(claimed, tmp_path) -> None:
    log = tmp_path / "events.jsonl"
    sink = EventSink(str(claimed.pk), log)
    sink.status("starting")
    sink.status("running")
    sink.metrics(1, {"reward/mean": 0.25, "actor/kl": math.nan})
    sink.samples(1, [sample_item("2+2", reward=0.0)])
    sink.checkpoint(1, str(tmp_path / "ckpt"), 42)
    sink.log("warning", "step 1: every group was filtered out; no update this step")
    sink.heartbeat()
    sink.status("succeeded", "done")
    sink.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert ingest_events(claimed, events) == 8
    got = stored(claimed)
    assert got["run"] == (RunStatus.SUCCEEDED, 8, 1, {"reward/mean": 0.25})
    assert got["checkpoints"] == [(5, 1, str(tmp_path / "ckpt"), 42)]
    assert got["logs"][0][:2] == (6, "warning")
    assert Run.objects.get(pk=claimed.pk).heartbeat_at.timestamp() <= time.time()


def test_it_finds_samples_by_text(claimed, on_postgres) -> None:
    ingest_events(claimed, [samples(1, 1, "17+25", "3*3"), samples(2, 2, "17-25")])
    found = Sample.objects.filter(run=claimed, completion__icontains="ANSWER IS 17")
    assert sorted(found.values_list("seq", "index")) == [(1, 0), (2, 0)]
    if on_postgres:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'runs_sample' AND indexname LIKE '%%trgm'"
            )
            assert sorted(r[0] for r in cursor.fetchall()) == ["sample_completion_trgm", "sample_prompt_trgm"]


def test_it_keeps_one_metric_value_per_run_name_and_step(claimed) -> None:
    MetricPoint.objects.create(run=claimed, name="loss", step=1, value=1.0, time="2026-01-01T00:00:00Z")
    with pytest.raises(IntegrityError), transaction.atomic():
        MetricPoint.objects.create(run=claimed, name="loss", step=1, value=2.0, time="2026-01-01T00:00:00Z")


def test_it_keeps_the_first_value_when_a_resumed_run_repeats_a_step(claimed) -> None:
    ingest_events(claimed, [metrics(1, 5, loss=1.0)])
    ingest_events(claimed, [metrics(2, 5, loss=2.0)])  # new seq, same (name, step)
    assert MetricPoint.objects.get(run=claimed, name="loss", step=5).value == 1.0
    assert Run.objects.get(pk=claimed.pk).last_seq == 2


def test_it_keeps_one_log_line_per_seq(claimed) -> None:
    LogLine.objects.create(run=claimed, seq=1, message="a", time="2026-01-01T00:00:00Z")
    with pytest.raises(IntegrityError), transaction.atomic():
        LogLine.objects.create(run=claimed, seq=1, message="b", time="2026-01-01T00:00:00Z")


@pytest.mark.django_db(transaction=True)
def test_it_stores_a_batch_once_when_two_connections_ingest_it_together(run) -> None:
    """The worker reconnects while the old socket is still flushing: both ingest the same events."""
    import threading

    from django.db import connections

    run.start(worker_host="cpu-1")
    events = a_run_of(20)
    barrier = threading.Barrier(2)
    results: list[int | BaseException] = []

    def ship() -> None:
        try:
            barrier.wait()
            results.append(ingest_events(Run.objects.get(pk=run.pk), events))
        except BaseException as exc:
            results.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=ship) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [len(events), len(events)]
    assert Sample.objects.filter(run=run).count() == 40
    assert LogLine.objects.filter(run=run).count() == 1
