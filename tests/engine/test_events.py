"""The JSONL event log: protocol fields, strictly increasing seq, torn lines, resume."""

from __future__ import annotations

import json
import math

from engine.contracts import EVENT_TYPES
from tributary.events import EventSink, last_seq_in


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_event_type_has_protocol_fields(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    sink = EventSink("r1", path)
    sink.status("running", "go")
    sink.metrics(1, {"reward/mean": 0.5, "bad": math.nan})
    sink.samples(1, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    sink.checkpoint(1, "/x", 10)
    sink.log("info", "hello")
    sink.heartbeat()
    sink.close()
    events = read(path)
    assert [e["seq"] for e in events] == [1, 2, 3, 4, 5, 6]
    assert {e["type"] for e in events} == set(EVENT_TYPES)
    assert all(e["run"] == "r1" for e in events)
    metrics = events[1]
    assert metrics["values"] == {"reward/mean": 0.5, "bad": None}  # JSON has no NaN
    assert metrics["step"] == 1 and metrics["time"] > 0


def test_seq_continues_after_reopen_and_torn_line(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    sink = EventSink("r", path)
    for _ in range(3):
        sink.log("info", "x")
    sink.close()
    with path.open("a") as fh:
        fh.write('{"run":"r","seq":4,"type":"lo')  # a crash mid-line
    assert last_seq_in(path) == 3
    sink = EventSink("r", path, start_seq=2)  # a checkpoint older than the log
    assert sink.log("info", "after") == 4
    sink.close()
    events = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    assert [e["seq"] for e in events] == [1, 2, 3, 4]


def test_start_seq_from_checkpoint_wins_when_log_is_new(tmp_path) -> None:
    sink = EventSink("r", tmp_path / "new.jsonl", start_seq=41)
    assert sink.heartbeat() == 42
