"""The run supervisor with a real engine subprocess (tiny model) and a real WebSocket web side."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from jobs.supervisor import (
    ENGINE_STARTING,
    RUNS_DIR_ENV,
    RunResult,
    RunSupervisor,
    describe_exit,
    last_status,
    output_tail,
)
from tests.tiny_runs import tiny_config
from tributary.events import EventSink

from .conftest import read_log


@pytest.fixture
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "runs"
    monkeypatch.setenv(RUNS_DIR_ENV, str(path))
    return path


def supervise(fake, run_id: int, config: dict[str, Any], **options: Any) -> RunSupervisor:
    options.setdefault("drain_timeout", 60)
    options.setdefault("connect_timeout", 60)
    options.setdefault("shipper_options", {"backoff_base": 0.05, "backoff_cap": 0.5})
    return RunSupervisor(run_id, config, fake.valid_token, web_url=fake.url, **options)


def run_in_thread(sup: RunSupervisor) -> tuple[threading.Thread, list[RunResult]]:
    out: list[RunResult] = []
    thread = threading.Thread(target=lambda: out.append(sup.run()))
    thread.start()
    return thread, out


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def has_trained(fake) -> bool:
    return any(e["type"] == "metrics" and e["step"] >= 1 for e in fake.stored.values())


def assert_log_shipped_exactly_once(fake, events_path: Path) -> list[dict[str, Any]]:
    events = read_log(events_path)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert fake.events() == events
    assert all(fake.received[s] == 1 for s in seqs)
    return events


def test_a_short_run_succeeds_and_every_event_arrives_once(
    fake_ingest, tiny_model_dir: Path, runs_dir: Path
) -> None:
    fake = fake_ingest(11)
    sup = supervise(fake, 11, tiny_config(tiny_model_dir, total_steps=2))
    result = sup.run()
    assert (result.started, result.state, result.exit_code, result.drained) == (True, "succeeded", 0, True)
    workdir = runs_dir / "11"
    assert sup.workdir == workdir
    assert json.loads((workdir / "config.json").read_text())["output_dir"] == str(workdir)
    events = assert_log_shipped_exactly_once(fake, workdir / "events.jsonl")
    assert result.acked_seq == events[-1]["seq"]
    states = [e["state"] for e in events if e["type"] == "status"]
    # "starting" once per preparing phase (tests/jobs/test_preparing_phases.py), then the rest.
    assert states[0] == "starting" and states[states.index("running") :] == ["running", "succeeded"]
    assert any(e["type"] == "heartbeat" for e in events)
    (conn,) = fake.conns
    assert len(conn.attach) == 1 and conn.attach[0]["pid"] == os.getpid()
    assert conn.attach[0]["engine_from"] == 0  # a fresh directory: no earlier engine's seqs
    assert fake.status == "succeeded"
    ckpt = next(e for e in events if e["type"] == "checkpoint")
    assert Path(ckpt["path"]).is_relative_to(workdir) and Path(ckpt["path"]).is_dir()


def test_cancel_stops_the_engine_with_a_checkpoint(fake_ingest, tiny_model_dir: Path, runs_dir: Path) -> None:
    fake = fake_ingest(12)
    fake.cancel_when = has_trained  # the user presses cancel once the run has trained a step
    sup = supervise(fake, 12, tiny_config(tiny_model_dir, total_steps=500), cancel_grace=120)
    result = sup.run()
    assert (result.state, result.exit_code, result.drained) == ("cancelled", 3, True)
    events = assert_log_shipped_exactly_once(fake, runs_dir / "12" / "events.jsonl")
    assert events[-1]["type"] == "status" and events[-1]["state"] == "cancelled"
    assert any(e["type"] == "log" and "SIGTERM" in e["message"] for e in events)
    ckpt = [e for e in events if e["type"] == "checkpoint"][-1]
    assert 1 <= ckpt["step"] < 500
    path = Path(ckpt["path"])
    assert path.is_relative_to(runs_dir / "12") and any(path.iterdir())
    assert fake.status == "cancelled"


def test_a_cancel_while_the_engine_starts_ends_cancelled(fake_ingest, tiny_model_dir: Path, runs_dir: Path) -> None:
    fake = fake_ingest(18)
    fake.cancel_when = lambda f: bool(f.stored)  # at the engine's first event, while it loads the model
    result = supervise(fake, 18, tiny_config(tiny_model_dir, total_steps=500)).run()
    # Killed by SIGTERM before its handler was installed (the supervisor reports it), or stopped
    # by the handler before step 1 (the engine reports it): either way the run ends cancelled.
    assert result.state == "cancelled" and result.exit_code in (3, -signal.SIGTERM)
    events = assert_log_shipped_exactly_once(fake, runs_dir / "18" / "events.jsonl")
    assert events[-1]["type"] == "status" and events[-1]["state"] == "cancelled"
    if result.exit_code < 0:
        assert "SIGTERM" in events[-1]["message"] and "cancelled by the test" in events[-1]["message"]
    assert fake.status == "cancelled"


def test_an_engine_killed_by_sigkill_ends_failed_with_its_output(
    fake_ingest, tiny_model_dir: Path, runs_dir: Path
) -> None:
    fake = fake_ingest(13)
    sup = supervise(fake, 13, tiny_config(tiny_model_dir, total_steps=500))
    thread, out = run_in_thread(sup)
    try:
        fake.wait_for(has_trained, timeout=120)
    finally:
        assert sup.proc is not None
        (engine,) = children_of(sup.proc.pid)  # the engine, under its launcher
        os.kill(engine, signal.SIGKILL)  # the kernel's OOM killer, say
        thread.join(120)
    (result,) = out
    assert (result.state, result.exit_code, result.drained) == ("failed", -signal.SIGKILL, True)
    events = assert_log_shipped_exactly_once(fake, runs_dir / "13" / "events.jsonl")
    tail, status = events[-2:]
    assert tail["type"] == "log" and tail["level"] == "error" and "SIGKILL" in tail["message"]
    assert "Loading weights" in tail["message"]  # the engine's own output (progress bars: their last state)
    assert status["type"] == "status" and status["state"] == "failed" and "SIGKILL" in status["message"]
    assert fake.status == "failed"


def test_a_bad_config_fails_with_the_engines_message_after_the_stored_cursor(
    fake_ingest, tiny_model_dir: Path, runs_dir: Path
) -> None:
    fake = fake_ingest(14, last_seq=7)  # a resume: the web app holds seqs up to 7 already
    config = tiny_config(tiny_model_dir, total_steps=1)
    config["rollout"]["n"] = 0
    result = supervise(fake, 14, config, start_seq=7).run()
    assert (result.started, result.state, result.exit_code) == (True, "failed", 2)
    confined, starting, log, status = fake.events()
    assert (confined["seq"], starting["seq"], log["seq"], status["seq"]) == (8, 9, 10, 11)
    assert confined["type"] == "log" and confined["message"].startswith("confined:")
    assert (starting["state"], starting["message"]) == ("starting", ENGINE_STARTING)
    assert log["level"] == "error" and "rollout.n" in log["message"] and "bad config" in log["message"]
    assert status["state"] == "failed"


@pytest.mark.parametrize("status", ["cancelled", "succeeded"])
def test_a_run_already_final_is_never_started(fake_ingest, tiny_model_dir: Path, runs_dir: Path, status: str) -> None:
    fake = fake_ingest(15, status=status)
    result = supervise(fake, 15, tiny_config(tiny_model_dir, total_steps=2)).run()
    assert (result.started, result.state, result.exit_code) == (False, status, None)
    assert not (runs_dir / "15" / "engine.log").exists() and not (runs_dir / "15" / "events.jsonl").exists()
    (conn,) = fake.conns
    assert conn.attach == [] and fake.stored == {}


def test_a_cancel_pending_at_hello_ends_cancelled_without_the_engine(
    fake_ingest, tiny_model_dir: Path, runs_dir: Path
) -> None:
    fake = fake_ingest(16)
    fake.cancel_pending = True
    result = supervise(fake, 16, tiny_config(tiny_model_dir, total_steps=2)).run()
    assert (result.started, result.state, result.drained) == (False, "cancelled", True)
    assert not (runs_dir / "16" / "engine.log").exists()
    (event,) = fake.events()
    assert event["type"] == "status" and event["state"] == "cancelled" and event["seq"] == 1
    assert fake.status == "cancelled"


def test_a_refused_token_does_not_start_the_engine(fake_ingest, tiny_model_dir: Path, runs_dir: Path) -> None:
    fake = fake_ingest(17)
    sup = RunSupervisor(17, tiny_config(tiny_model_dir, total_steps=2), "forged", web_url=fake.url)
    result = sup.run()
    assert (result.started, result.state) == (False, "not started")
    assert "4401" in result.error and "not valid" in result.error
    assert sup.proc is None and fake.refused == [("forged", 4401)]


def test_the_final_status_is_looked_for_in_what_this_engine_wrote(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = EventSink("9", path)
    sink.status("cancelled", "an earlier attempt")
    sink.close()
    start = path.stat().st_size
    assert last_status(path)["state"] == "cancelled"
    assert last_status(path, after=start) is None
    sink = EventSink("9", path)
    sink.status("starting")
    for i in range(2000):
        sink.log("info", f"line {i} " + "x" * 600)  # more than the tail that is read first
    sink.close()
    assert last_status(path, after=start)["state"] == "starting"
    assert last_status(path, after=start, tail_bytes=4096)["state"] == "starting"


def test_output_tail_and_exit_descriptions(tmp_path: Path) -> None:
    out = tmp_path / "engine.log"
    out.write_text("".join(f"line {i}\n" for i in range(100)) + "bar 10%\rbar 50%\rbar 100%\n\nerror: boom\n")
    tail = output_tail(out).splitlines()
    assert len(tail) == 40 and tail[-2:] == ["bar 100%", "error: boom"] and tail[0] == "line 62"
    assert output_tail(tmp_path / "missing") == ""
    assert describe_exit(-signal.SIGKILL) == "the engine was killed by SIGKILL"
    assert describe_exit(2) == "the engine exited with code 2 (bad config)"


def test_the_seqs_an_earlier_engine_left_are_named_in_attach_and_shipped_first(
    fake_ingest, tiny_model_dir: Path, runs_dir: Path
) -> None:
    """A resume in the directory of a lost attempt: that engine's unshipped tail (seqs 1-3 here)
    goes first, and ``attach`` says where it ends, so the web app files it under that attempt."""
    workdir = runs_dir / "21"
    workdir.mkdir(parents=True)
    tail = [
        {"run": "21", "seq": 1, "type": "status", "state": "running", "message": "training on cpu"},
        {"run": "21", "seq": 2, "type": "log", "level": "warning", "message": "received SIGTERM"},
        {"run": "21", "seq": 3, "type": "status", "state": "cancelled", "message": "stopped at step 0"},
    ]
    (workdir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in tail))
    fake = fake_ingest(21)
    result = supervise(fake, 21, tiny_config(tiny_model_dir, total_steps=1)).run()
    (conn,) = fake.conns
    assert conn.attach[0]["engine_from"] == 3
    events = fake.events()
    assert events[:3] == tail and [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert result.started and events[3]["seq"] == 4  # the new engine numbers after the tail
