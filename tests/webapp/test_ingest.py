from __future__ import annotations

import json
import math
import re
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction

from tests.webapp.event_builders import T0, a_run_of, metrics, sample_item, samples, status
from tests.webapp.test_series_rollups import rollup_rows
from tributary.events import EventSink
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import InvalidEvent, store_events
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample


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


def a_second_run(run: Run, name: str) -> Run:
    """Another run of ``run``'s project, claimed as ``claimed`` is."""
    other = Run.objects.create(project=run.project, name=name)
    other.start(worker_host="cpu-2")
    return other


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

    other = a_second_run(run, "reference")
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


UNPLACEABLE = [
    ({"seq": 0, "type": "heartbeat", "time": T0}, "field 'seq' must be an integer in [1, 2^63)"),
    ({"seq": "3", "type": "heartbeat", "time": T0}, "field 'seq' must be an integer in [1, 2^63)"),
    ({"seq": 2**63, "type": "heartbeat", "time": T0}, "field 'seq' must be an integer in [1, 2^63)"),
    ({"type": "heartbeat", "time": T0}, "field 'seq' must be an integer in [1, 2^63)"),
]


@pytest.mark.parametrize(("bad", "message"), UNPLACEABLE, ids=[repr(b.get("seq")) for b, _ in UNPLACEABLE])
def test_it_refuses_a_batch_with_an_event_it_cannot_place_and_writes_nothing(claimed, bad, message) -> None:
    """Without a usable seq the cursor cannot move past the event: the whole batch is refused."""
    good = a_run_of(1)[:2]
    before = stored(claimed)
    with pytest.raises(InvalidEvent, match=re.escape(message)) as refused:
        ingest_events(claimed, [*good, bad])
    assert (refused.value.seq, refused.value.field) == ("? (item 2)", "seq")
    assert stored(claimed) == before


BAD_EVENTS = [
    ({"seq": 3, "type": "telemetry"}, "event seq 3: field 'type' is 'telemetry'; known types"),
    ({"seq": 3}, "event seq 3: field 'type' is None"),
    ({"seq": 3, "type": "metrics", "time": T0, "values": {}}, "event seq 3: field 'step' is missing"),
    ({"seq": 3, "type": "metrics", "step": True, "time": T0, "values": {}}, "field 'step' must be an integer"),
    ({"seq": 3, "type": "metrics", "step": -1, "time": T0, "values": {}}, "field 'step' must be an integer"),
    ({"seq": 3, "type": "metrics", "step": 2**31, "time": T0, "values": {}}, "field 'step' must be an integer"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": math.nan}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": math.inf}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": 10**400}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"loss": "0.1"}}, "field 'values.loss' must be a finite number"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": [1.0]}, "field 'values' must be an object"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": T0, "values": {"x" * 201: 1.0}}, "has a bad metric name"),
    ({"seq": 3, "type": "metrics", "step": 1, "time": math.nan, "values": {}}, "field 'time' must be a finite number"),
    ({"seq": 3, "type": "samples", "step": 1}, "field 'items' is missing"),
    ({"seq": 3, "type": "samples", "step": 1, "items": [{"prompt": "p"}]}, "field 'items[0].completion' is missing"),
    ({"seq": 3, "type": "samples", "step": 1, "items": [{**sample_item("x"), "reward": math.inf}]}, "field 'items[0].reward' must be a finite"),
    ({"seq": 3, "type": "samples", "step": 1, "items": [{**sample_item("x"), "length": 2**31}]}, "field 'items[0].length' must be an integer"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "path": "c", "bytes": -5}, "field 'bytes' must be an integer in [0, 2^63)"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "path": "c", "bytes": 2**63}, "field 'bytes' must be an integer in [0, 2^63)"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "bytes": 5}, "field 'path' is missing"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "path": "c", "bytes": 5, "deleted": "b"}, "field 'deleted' must be a list of checkpoint paths"),
    ({"seq": 3, "type": "checkpoint", "step": 1, "path": "c", "bytes": 5, "deleted": ["a", 7]}, "field 'deleted[1]' must be a path"),
    ({"seq": 3, "type": "log", "level": "shout", "message": "x"}, "field 'level' is 'shout'; known levels"),
    ({"seq": 3, "type": "status", "state": "paused"}, "field 'state' is 'paused'; known states"),
    ({"seq": 3, "type": "heartbeat"}, "field 'time' is missing"),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "message"), BAD_EVENTS, ids=[m.split(":")[-1][:40] for _, m in BAD_EVENTS])
def test_it_quarantines_a_bad_event_and_stores_the_rest(claimed, bad, message) -> None:
    """A bad event with a usable seq takes its place as an error log line that says what was
    wrong; the events around it are stored, and the cursor moves past it."""
    good = a_run_of(1)[:2]
    later = metrics(4, 2, **{"reward/mean": 1.0})
    assert ingest_events(claimed, [*good, bad, later]) == 4
    got = stored(claimed)
    assert got["metrics"] == [("reward/mean", 2, 1.0)]
    [(seq, level, text)] = got["logs"]
    assert (seq, level) == (3, "error")
    assert f"event 3 ({bad.get('type') or '?'}) was quarantined" in text and message in text


@pytest.mark.parametrize(
    ("value", "kept"),
    [(0.5, 0.5), (7, 7.0), (1.7e308, 1.7e308), (None, None), (True, "quarantined"), (math.nan, "quarantined"),
     (math.inf, "quarantined"), ("0.1", "quarantined")],
)  # fmt: skip
def test_values_under_names_seen_before_are_still_checked(claimed, value: Any, kept: Any) -> None:
    """A metrics event whose names were all found clean before and whose values are all finite
    floats is taken whole (``ingest._plain_values``, issue 19); any other value is still checked
    as before: an integer stored as a float, null as a non-finite value (no point), the rest
    quarantined. 1.7e308 twice sums to infinity: checked one by one, and kept."""
    ingest_events(claimed, [metrics(1, 1, loss=1.0, acc=1.7e308)])  # the names, seen and clean
    ingest_events(claimed, [metrics(2, 2, loss=value, acc=1.7e308)])
    points = dict(MetricPoint.objects.filter(run=claimed, step=2).values_list("name", "value"))
    errors = list(LogLine.objects.filter(run=claimed, level="error").values_list("seq", "message"))
    run = Run.objects.get(pk=claimed.pk)
    if kept == "quarantined":  # by the checks (not by the database, as a NaN would be on SQLite)
        assert (points, [seq for seq, _ in errors], run.last_seq) == ({}, [2], 2)
        assert "field 'values.loss' must be a finite number" in errors[0][1]
        return
    assert errors == [] and points.pop("acc") == 1.7e308
    assert points == ({} if kept is None else {"loss": kept})
    # Read back as the doubles they were checked into: an int as 7.0, and 1.7e308, which jsonb
    # prints as 309 digits, as 1.7e308 (``models.DoublesDecoder``).
    assert run.summary["loss"] == (1.0 if kept is None else kept) and type(run.summary["loss"]) is float
    assert run.summary["acc"] == 1.7e308 and type(run.summary["acc"]) is float


def test_a_summary_reads_back_every_double_as_sent(claimed) -> None:
    """jsonb keeps numbers as ``numeric`` and prints them without an exponent (1e16 as
    ``10000000000000000``): read with ``json`` alone, the summary's large doubles came back as
    integers on PostgreSQL, and the API answered them so. Bit for bit, on both databases."""
    values = {
        "a": 1e16,
        "b": -1e20,
        "c": 1.7976931348623157e308,
        "d": 2.5e-300,
        "e": 0.1 + 0.2,
        "f": 1e16 + 2,
    }
    ingest_events(claimed, [metrics(1, 1, **values)])
    summary = Run.objects.get(pk=claimed.pk).summary
    assert {k: (type(v), v.hex()) for k, v in summary.items()} == {
        k: (float, v.hex()) for k, v in values.items()
    }


def test_an_invalid_event_is_a_value_error_naming_seq_and_field() -> None:
    error = InvalidEvent(7, "values.loss", "must be a finite number, got nan")
    assert isinstance(error, ValueError)
    assert (error.seq, error.field) == (7, "values.loss")
    assert str(error) == "event seq 7: field 'values.loss' must be a finite number, got nan"


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


def test_it_stores_every_metric_name_and_value_exactly(claimed) -> None:
    """The points go to PostgreSQL as binary COPY data built by ``bulk.copy_data``: names holding
    the text format's delimiters and escapes come back as sent, every double bit for bit, and each
    time to the microsecond, before PostgreSQL's epoch (2000-01-01) as after it."""
    names = ["tab\there", "back\\slash\\N", "new\nline", "carriage\rreturn", "\\.", "ünï/cødé ✓", "a" * 200]
    values = [0.1 + 0.2, 2.2250738585072014e-308, 1.7976931348623157e308, 1e-05, -2.5e-300, 1e16 + 2, 1 / 3]
    events = [
        {**metrics(seq, seq), "values": {n: v * (-1) ** seq for n, v in zip(names, values, strict=True)}}
        for seq in (1, 2)
    ]
    events[1]["values"]["an/int"] = 7  # JSON without a point: an int, stored as a double
    events[0]["time"] = 946_684_799.999_999  # 1 µs before 2000-01-01 UTC
    events[1]["time"] = T0 + 2.000_001
    ingest_events(claimed, events)
    got = {(p.name, p.step): p.value for p in MetricPoint.objects.filter(run=claimed)}
    expected = {(n, e["step"]): float(v) for e in events for n, v in e["values"].items()}
    assert got.keys() == expected.keys()
    assert [k for k in expected if got[k].hex() != expected[k].hex()] == []
    point = MetricPoint.objects.get(run=claimed, name="tab\there", step=2)
    assert point.time == datetime(2025, 10, 9, 8, 53, 22, 1, tzinfo=UTC)  # T0 + 2.000001
    assert point.seq == 2 and point.attempt == 1 and not point.superseded
    first = MetricPoint.objects.get(run=claimed, name="tab\there", step=1).time
    assert first == datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)


def test_a_point_out_of_its_columns_range_is_the_datas_fault() -> None:
    """``bulk.copy_data`` packs each number into its column's width. Validation bounds every one
    (a step to an integer, a seq to a bigint), so none overflows from ingest; should one, it raises
    ``ValueError``, which ``is_poison`` counts as the data's fault (quarantined) and not the
    database's (a resend that would fail forever), as the driver's own error for the value does."""
    from webapp.runs.bulk import PointGroup, copy_data
    from webapp.runs.ingest import is_poison

    at = datetime.fromtimestamp(T0, tz=UTC)
    assert copy_data([PointGroup(1, 2**31 - 1, at, 2**63 - 1, 1, {"loss": 1.0})])
    for step, seq in ((2**31, 1), (1, 2**63)):
        with pytest.raises(ValueError, match="cannot hold") as raised:
            copy_data([PointGroup(1, step, at, seq, 1, {"loss": 1.0})])
        assert is_poison(raised.value)


def analysis(run: Run) -> dict[str, Any]:
    """The summaries and rollups ingest keeps for a run, comparable across runs."""
    from webapp.analysis.models import MetricSummary

    summaries = MetricSummary.objects.filter(run=run).values_list("name", "last", "last_step", "min", "max", "count")
    return {"summaries": sorted(summaries), "rollups": rollup_rows(run)}


def test_a_batch_prepared_before_the_lock_stores_what_the_batch_alone_stores(claimed, run, monkeypatch) -> None:
    """The ingest socket builds a batch's insert data, rollup blocks and summary fold before the
    run's row is locked (``ingest.prepare``, issue 19). Stored with it, a run holds exactly what it
    holds from the batch alone (points, summaries, rollups, bit for bit), and nothing is built
    twice: the storing thread takes what was prepared."""
    from webapp.analysis import rollups, summaries
    from webapp.runs import bulk
    from webapp.runs.ingest import prepare, store_validated, validated

    events = [
        metrics(seq, seq * 3, loss=1 / seq, acc=seq * 0.1, **{"tab\tname": -seq * 1e300}) for seq in range(1, 41)
    ]
    reference = a_second_run(run, "reference")
    store_events(reference.pk, events[:20])
    store_events(reference.pk, events[20:])

    built: list[str] = []
    for module, name in ((bulk, "insert_data"), (rollups, "upsert_data"), (summaries, "fold_new")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: built.append(_name) or _real(*a, **k))
    for part in (events[:20], events[20:]):
        batch = validated(part)
        ready = prepare(claimed.pk, claimed.attempt_number, batch)
        built.clear()
        store_validated(claimed.pk, batch, attempt=claimed.attempt, prepared=ready)
        assert built == []  # the store built nothing the preparation had built
    assert stored(claimed)["metrics"] == stored(reference)["metrics"]
    assert analysis(claimed) == analysis(reference) and analysis(claimed)["rollups"]


def test_a_prepared_batch_the_run_has_moved_past_is_not_taken(claimed, run) -> None:
    """A batch prepared as wholly new whose first events are stored already by the time its lock is
    taken (a resend after a lost ack overlapping the batch before) stores from the run's own state:
    the groups ``_store`` builds differ from the prepared ones, so nothing prepared is used."""
    from webapp.runs.ingest import prepare, store_validated, validated

    events = [metrics(seq, seq, loss=float(seq), acc=1 / seq) for seq in range(1, 31)]
    reference = a_second_run(run, "reference")  # the same batches, nothing prepared
    store_events(reference.pk, events[:12])
    store_events(reference.pk, events)

    batch = validated(events)
    ready = prepare(claimed.pk, claimed.attempt_number, batch)
    store_events(claimed.pk, events[:12])  # stored in between: the points up to seq 12
    store_validated(claimed.pk, batch, attempt=claimed.attempt, prepared=ready)
    assert stored(claimed)["metrics"] == stored(reference)["metrics"]
    assert analysis(claimed) == analysis(reference)
    # A preparation for another attempt's number is not taken either.
    other = a_second_run(run, "other attempt")
    store_validated(other.pk, batch[:12], attempt=other.attempt)
    store_validated(other.pk, batch, attempt=other.attempt, prepared=prepare(other.pk, 2, batch))
    assert set(MetricPoint.objects.filter(run=other).values_list("attempt", flat=True)) == {1}
    assert analysis(other) == analysis(reference)


def test_the_bulk_insert_says_whether_the_database_took_every_point(claimed) -> None:
    """``bulk.insert_point_groups`` is True only when every point was inserted (the rollups then
    aggregate the batch in memory, ``webapp.analysis.rollups.record``): a point stored already,
    or twice in one call, is ignored (its first value kept) and makes it False."""
    from webapp.runs.bulk import PointGroup as G
    from webapp.runs.bulk import insert_point_groups

    at = datetime.fromtimestamp(T0, tz=UTC)
    run = claimed.pk
    with transaction.atomic():
        assert insert_point_groups([G(run, 1, at, 1, 1, {"loss": 1.0, "acc": 0.5}), G(run, 2, at, 2, 1, {})])
        assert not insert_point_groups(
            [G(run, 1, at, 3, 1, {"loss": 9.0}), G(run, 3, at, 3, 1, {"loss": 3.0})]
        )
        assert not insert_point_groups(
            [G(run, 4, at, 4, 1, {"loss": 4.0}), G(run, 4, at, 5, 1, {"loss": 5.0})]
        )
        assert insert_point_groups([G(run, 1, at, 6, 2, {"loss": 6.0})])  # another attempt's step 1
        assert insert_point_groups([G(run, 5, at, 7, 1, {})])  # nothing to store
    got = sorted(MetricPoint.objects.filter(run=claimed).values_list("name", "step", "attempt", "value"))
    assert got == [
        ("acc", 1, 1, 0.5),
        ("loss", 1, 1, 1.0),
        ("loss", 1, 2, 6.0),
        ("loss", 3, 1, 3.0),
        ("loss", 4, 1, 4.0),
    ]


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


@pytest.mark.django_db(transaction=True)
def test_a_batch_asks_for_the_row_only_after_the_batch_before_it_holds_it(run) -> None:
    """Two batches of one socket stored at once (``ingest.Turn``): the second, here started first,
    copies its points (PostgreSQL) and waits until the first holds the run's row. Asking for the
    row first, it would find the cursor short of its first seq and be refused with a gap."""
    import threading

    from django.db import connections

    from webapp.runs.ingest import Turn, prepare, store_validated, validated

    run.start(worker_host="cpu-1")
    batches = [validated([metrics(1, 1, loss=1.0), metrics(2, 2, loss=2.0)]), validated([metrics(3, 3, loss=3.0)])]
    first = Turn()
    turns = [first, Turn(first)]
    results: dict[int, Any] = {}

    def store(i: int) -> None:
        try:
            ready = prepare(run.pk, run.attempt_number, batches[i])
            results[i] = store_validated(run.pk, batches[i], attempt=run.attempt, prepared=ready, turn=turns[i])
        except BaseException as exc:
            results[i] = exc
        finally:
            connections.close_all()

    second = threading.Thread(target=store, args=(1,))
    second.start()
    second.join(0.5)
    assert second.is_alive() and results == {}  # waiting for its turn, not answered with a gap
    assert Run.objects.get(pk=run.pk).last_seq == 0
    first_thread = threading.Thread(target=store, args=(0,))
    first_thread.start()
    first_thread.join(30)
    second.join(30)
    assert [getattr(results.get(i), "last_seq", results.get(i)) for i in (0, 1)] == [2, 3]
    assert sorted(MetricPoint.objects.filter(run=run).values_list("seq", "value")) == [(1, 1.0), (2, 2.0), (3, 3.0)]


@pytest.mark.postgresql
@pytest.mark.django_db(transaction=True)
def test_a_batch_stored_again_keeps_its_place_before_the_batch_after_it(run, monkeypatch) -> None:
    """A batch whose early copy is not what it stores lets go of the run's row and is stored again
    (``_Redo``: here its preparation was for another attempt). The batch after it must not take
    the row in between: it would find the cursor short of its first seq (a gap). Each check of a
    copy is slowed so that the batch after has asked for the row by then, if it may."""
    import threading

    from django.db import connections

    from webapp.runs import ingest
    from webapp.runs.ingest import Turn, prepare, store_validated, validated

    checked = ingest._copied_all
    monkeypatch.setattr(ingest, "_copied_all", lambda *a: time.sleep(0.3) or checked(*a))
    run.start(worker_host="cpu-1")
    batches = [validated([metrics(1, 1, loss=1.0)]), validated([metrics(2, 2, loss=2.0)])]
    first = Turn()
    turns, attempts = [first, Turn(first)], [run.attempt_number + 1, run.attempt_number]
    results: dict[int, Any] = {}

    def store(i: int) -> None:
        try:
            ready = prepare(run.pk, attempts[i], batches[i])
            results[i] = store_validated(run.pk, batches[i], attempt=run.attempt, prepared=ready, turn=turns[i])
        except BaseException as exc:
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=store, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [getattr(results.get(i), "last_seq", results.get(i)) for i in (0, 1)] == [1, 2]
    assert sorted(MetricPoint.objects.filter(run=run).values_list("seq", "value", "attempt")) == [
        (1, 1.0, 1), (2, 2.0, 1)
    ]  # fmt: skip


@pytest.mark.postgresql
@pytest.mark.django_db(transaction=True)
def test_a_batch_whose_turn_is_long_in_coming_waits_without_holding_its_copy(run, monkeypatch) -> None:
    """PostgreSQL cannot see a batch wait for its turn: held there with its copied points, it could
    hold what the batch before waits for in the database. Past ``TURN_WAIT_S`` (1 s here) it rolls back
    (no lock left on the points table) and waits outside any transaction; its turn come, it is
    stored the usual way."""
    import threading

    from django.db import connections

    from webapp.runs import ingest
    from webapp.runs.ingest import Turn, prepare, store_validated, validated

    monkeypatch.setattr(ingest, "TURN_WAIT_S", 1.0)
    run.start(worker_host="cpu-1")
    store_events(run.pk, [metrics(1, 1, loss=1.0)])
    before = Turn()  # a batch not stored yet
    batch = validated([metrics(2, 2, loss=2.0)])
    results: list[Any] = []

    def store() -> None:
        try:
            ready = prepare(run.pk, run.attempt_number, batch)
            results.append(store_validated(run.pk, batch, attempt=run.attempt, prepared=ready, turn=Turn(before)))
        except BaseException as exc:
            results.append(exc)
        finally:
            connections.close_all()

    def points_table_lockers() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = %s AND l.pid <> pg_backend_pid()",
                [MetricPoint._meta.db_table],
            )
            return cursor.fetchone()[0]

    def until(held: bool) -> bool:  # polled: what the load delays is the moment, not the outcome
        deadline = time.monotonic() + 10
        while bool(points_table_lockers()) != held and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(points_table_lockers()) == held

    waiting = threading.Thread(target=store)
    waiting.start()
    assert until(held=True) and waiting.is_alive()  # the copy, holding it while it waits for its turn
    assert until(held=False)  # past TURN_WAIT_S: rolled back (held, it fails after 10 s)
    assert waiting.is_alive() and results == []  # and still waiting for its turn
    before.held.set()
    waiting.join(30)
    assert [getattr(r, "last_seq", r) for r in results] == [2]
    assert sorted(MetricPoint.objects.filter(run=run).values_list("seq", "value")) == [(1, 1.0), (2, 2.0)]


def test_a_prepared_batch_the_database_refuses_part_of_stores_what_the_batch_alone_stores(
    claimed, run, refuse_poison_in_the_database
) -> None:
    """A batch whose points were copied before the row lock (PostgreSQL) and which holds an event
    the database refuses is stored again without them (``ingest._Redo``) and quarantined event by
    event: what it stores equals the plain path's, its points once each."""
    from webapp.runs.ingest import prepare, store_validated, validated

    events = a_run_of(3)  # samples at seq 4, 6, 8
    events[5] = samples(6, 2, "POISON", "fine")
    reference = a_second_run(run, "reference")
    store_events(reference.pk, events)
    batch = validated(events)
    store_validated(claimed.pk, batch, attempt=claimed.attempt, prepared=prepare(claimed.pk, 1, batch))
    mine, theirs = stored(claimed), stored(reference)
    for got in (mine, theirs):  # the database's message names the failing row (its run's id)
        got["logs"] = [(seq, level, message.split(": new row")[0]) for seq, level, message in got["logs"]]
    assert mine == theirs and len(mine["metrics"]) == 6 and mine["logs"][0][:2] == (6, "error")
    assert analysis(claimed) == analysis(reference)


# --- storable text, bounded depth, quarantine of what the database refuses (issue 13) ---------


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(levels):
        value = {"d": value}
    return value


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_it_makes_unstorable_text_storable_everywhere(claimed) -> None:
    """NUL and lone surrogates become U+FFFD in text columns, metric names, and JSON keys and
    values at any depth; JSON deeper than tributary.events.MAX_DEPTH is cut with a mark. On
    PostgreSQL every one of these failed the whole batch before (jsonb and text refuse NUL)."""
    from tributary.events import DEPTH_MARK, MAX_DEPTH

    item = {
        **sample_item("x"),
        "prompt": "Q\x00?",
        "completion": "4\x00\ud800",
        "finish_reason": "st\x00op",
        "extra": {"answer\x00": ["4\x00", {"k\ud800": "\udfff"}], "deep": _deep(60)},
    }
    events = [
        status(1, "starting"),
        metrics(2, 1, **{"reward\x00/mean": 0.5}),
        {"run": "r", "seq": 3, "type": "samples", "step": 1, "items": [item]},
        {"run": "r", "seq": 4, "type": "log", "level": "info", "message": "bad \ud800 text \x00"},
        {"run": "r", "seq": 5, "type": "checkpoint", "step": 1, "path": "ck\x00pt", "bytes": 1},
        status(6, "running", "step\x00 0"),
    ]
    assert ingest_events(claimed, events) == 6
    sample = Sample.objects.get(run=claimed)
    assert (sample.prompt, sample.completion, sample.finish_reason) == (
        "Q\ufffd?",
        "4\ufffd\ufffd",
        "st\ufffdop",
    )
    assert sample.extra["answer\ufffd"] == ["4\ufffd", {"k\ufffd": "\ufffd"}]
    assert (
        4 + _depth(sample.extra) - 1 == MAX_DEPTH
    )  # extra is level 4 of the event: cut where the engine cuts
    assert DEPTH_MARK in json.dumps(sample.extra)
    assert list(MetricPoint.objects.filter(run=claimed).values_list("name", flat=True)) == [
        "reward\ufffd/mean"
    ]
    assert LogLine.objects.get(run=claimed, seq=4).message == "bad \ufffd text \ufffd"
    assert Checkpoint.objects.get(run=claimed).path == "ck\ufffdpt"
    run = Run.objects.get(pk=claimed.pk)
    assert (run.status, run.status_message, run.summary) == (
        RunStatus.RUNNING,
        "step\ufffd 0",
        {"reward\ufffd/mean": 0.5},
    )


def test_the_engine_sink_never_writes_unstorable_text(tmp_path) -> None:
    """The engine's log is the source of truth: it stays strict JSON the web app can store."""
    from tributary.events import DEPTH_MARK

    log = tmp_path / "events.jsonl"
    sink = EventSink("r", log)
    sink.samples(1, [{**sample_item("x"), "completion": "a\x00b", "reward": math.nan, "extra": _deep(50)}])
    sink.log("info", "lone \ud800 surrogate")
    sink.metrics(1, {"na\x00me": 1.0})
    sink.close()
    raw = log.read_bytes()
    assert b"\\u0000" not in raw and b"\x00" not in raw
    lines = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
        for line in raw.splitlines()
    ]
    item = lines[0]["items"][0]
    assert (item["completion"], item["reward"]) == ("a\ufffdb", None)
    assert DEPTH_MARK in json.dumps(item["extra"])
    assert lines[1]["message"] == "lone \ufffd surrogate"
    assert lines[2]["values"] == {"na\ufffdme": 1.0}


@pytest.fixture
def refuse_poison_in_the_database(on_postgres: bool) -> Any:
    """A real database rule that refuses one value (a CHECK constraint on PostgreSQL, a trigger
    on SQLite): stands for any data error ingest did not foresee, so the savepoint fallback is
    exercised against the database itself."""
    with connection.cursor() as cursor:
        if on_postgres:
            cursor.execute(
                "ALTER TABLE runs_sample ADD CONSTRAINT test_no_poison CHECK (completion NOT LIKE '%%POISON%%')"
            )
        else:
            cursor.execute(
                "CREATE TRIGGER test_no_poison BEFORE INSERT ON runs_sample "
                "WHEN NEW.completion LIKE '%POISON%' BEGIN SELECT RAISE(ABORT, 'poison refused'); END"
            )
    yield
    with connection.cursor() as cursor:
        if on_postgres:  # deferred foreign-key checks first, or PostgreSQL refuses the ALTER
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute("ALTER TABLE runs_sample DROP CONSTRAINT test_no_poison")
        else:
            cursor.execute("DROP TRIGGER test_no_poison")


def test_an_event_the_database_refuses_is_quarantined_and_the_rest_stored(
    claimed, refuse_poison_in_the_database
) -> None:
    events = a_run_of(3)  # samples at seq 4, 6, 8
    events[5] = samples(6, 2, "POISON", "fine")
    assert ingest_events(claimed, events) == len(events)
    got = stored(claimed)
    assert sorted({s[0] for s in got["samples"]}) == [4, 8]  # the whole refused event is out
    assert len(got["metrics"]) == 6 and got["checkpoints"] == [(9, 3, "ckpt/3", 1234)]
    quarantined = LogLine.objects.get(run=claimed, seq=6)
    assert quarantined.level == "error"
    assert "event 6 (samples) was quarantined, not stored: the database refused it" in quarantined.message
    run = Run.objects.get(pk=claimed.pk)
    assert (run.status, run.last_seq, run.last_step) == (RunStatus.RUNNING, len(events), 3)
    assert run.summary == {"reward/mean": 0.3, "actor/entropy": 1 / 3}


def test_the_engines_final_status_closes_the_attempt(claimed) -> None:
    from webapp.runs.ingest import IngestClosed

    forged = metrics(5, 9999, **{"reward/mean": 99.0})
    stored_ = store_events(claimed.pk, [status(1, "starting"), status(2, "running"), metrics(3, 1, loss=1.0),
                                        status(4, "succeeded", "done"), forged])  # fmt: skip
    assert (stored_.last_seq, stored_.final) == (4, True)  # nothing after the final status
    run = Run.objects.get(pk=claimed.pk)
    assert (run.status, run.final_seq, run.last_seq) == (RunStatus.SUCCEEDED, 4, 4)
    assert store_events(claimed.pk, [status(4, "succeeded", "done")]).last_seq == 4  # a resend: fine
    with pytest.raises(IngestClosed, match="its engine's final status was event 4"):
        store_events(claimed.pk, [forged])
    assert not MetricPoint.objects.filter(run=claimed, step=9999).exists()


def test_a_web_final_run_takes_the_tail_until_the_engines_final_status(claimed) -> None:
    """A run marked lost (or cancelled) by the web app still takes its worker's late events:
    the engine's own final status is what ends the attempt."""
    claimed.mark_lost("silent")
    store_events(claimed.pk, [status(1, "starting"), metrics(2, 1, loss=1.0), status(3, "failed", "boom")])
    run = Run.objects.get(pk=claimed.pk)
    assert (run.status, run.last_seq, run.final_seq) == (RunStatus.LOST, 3, 3)
    assert MetricPoint.objects.filter(run=claimed).count() == 1


def test_a_token_of_an_older_attempt_stores_nothing(claimed) -> None:
    from webapp.runs.tokens import TokenRejected, start_attempt

    start_attempt(claimed.pk)
    start_attempt(claimed.pk)
    with pytest.raises(TokenRejected, match=r"attempt 1 of run .* queued again \(attempt 2\)"):
        store_events(claimed.pk, [metrics(1, 1, loss=1.0)], attempt=1)
    assert store_events(claimed.pk, [metrics(1, 1, loss=1.0)], attempt=2).last_seq == 1


def test_stored_events_are_progress(claimed) -> None:
    Run.objects.filter(pk=claimed.pk).update(heartbeat_at=None)
    ingest_events(claimed, [{"run": "r", "seq": 1, "type": "heartbeat", "time": T0}])
    assert Run.objects.get(pk=claimed.pk).heartbeat_at is not None
