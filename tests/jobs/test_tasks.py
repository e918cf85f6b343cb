"""The real Celery task through a real worker (filesystem broker in a temporary directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery.contrib.testing.worker import start_worker

from jobs.app import SUPERVISE_TASK, make_app
from jobs.registry import FileRegistry
from jobs.supervisor import RUNS_DIR_ENV, WEB_URL_ENV
from jobs.worker import queues, worker_argv

from .conftest import read_log
from .test_supervisor import has_trained, tiny_config


def test_a_queued_run_is_supervised_by_a_worker_and_its_events_arrive(
    fake_ingest, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = fake_ingest(21)
    # What a worker machine has: the broker and the web app's address (no database).
    monkeypatch.setenv(WEB_URL_ENV, fake.url)
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "runs"))
    app = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path / "broker")})
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=60, loglevel="WARNING"):
        assert SUPERVISE_TASK in app.tasks
        # As webapp.runs.queueing.queue_run sends it.
        app.send_task(
            SUPERVISE_TASK,
            kwargs={
                "run_id": 21,
                "config": tiny_config(tiny_model_dir, total_steps=1),
                "token": fake.valid_token,
                "start_seq": 0,
                "resume_path": None,
            },
            queue="cpu",
        )
        try:
            fake.wait_for(lambda f: f.status == "succeeded" and f.conns and not f.connected, timeout=120)
        except AssertionError as exc:  # seen once in CI, unexplained: say where the run stopped
            raise AssertionError(f"{exc}\n{where_it_stopped(tmp_path, 21)}") from None
    events = read_log(tmp_path / "runs" / "21" / "events.jsonl")
    assert fake.events() == events and events[-1]["state"] == "succeeded"
    assert fake.conns[0].attach


def where_it_stopped(tmp_path: Path, run_id: int) -> str:
    """What a worker test that timed out left: the broker's queue (the message still there: no
    worker took it) and the run's directory (no directory: the task never started), with the
    tails of the engine's output and event log."""
    queued = sorted(p.name for p in (tmp_path / "broker" / "queue").glob("*")) if (tmp_path / "broker").exists() else []
    run_dir = tmp_path / "runs" / str(run_id)
    lines = [f"broker queue holds {len(queued)} message(s) {queued[:5]}", f"run directory exists: {run_dir.is_dir()}"]
    for name in ("engine.log", "events.jsonl"):
        if (run_dir / name).is_file():
            lines.append(f"--- {name} (tail) ---\n" + (run_dir / name).read_text(errors="replace")[-3000:])
    return "\n".join(lines)


def test_worker_arguments_come_from_the_environment() -> None:
    assert queues({}) == ["cpu"]
    assert queues({"TRIBUTARY_QUEUES": "gpu, cpu"}) == ["gpu", "cpu"]
    argv = worker_argv({"TRIBUTARY_QUEUES": "gpu", "TRIBUTARY_WORKER_NAME": "w1@box"})
    assert argv[:5] == ["worker", "--hostname", "w1@box", "--queues", "gpu"]
    with pytest.raises(SystemExit, match="TRIBUTARY_CONCURRENCY"):
        worker_argv({"TRIBUTARY_CONCURRENCY": "zero"})


def engine_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (a run's working directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(
                line for line in (entry / "status").read_text().splitlines() if line.startswith("State:")
            )
        except (OSError, StopIteration):
            continue
        if marker in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


def start_worker_process(tmp_path: Path, web_url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        TRIBUTARY_BROKER_DIR=str(tmp_path / "broker"),
        TRIBUTARY_WEB_URL=web_url,
        TRIBUTARY_RUNS_DIR=str(tmp_path / "runs"),
        TRIBUTARY_WORKER_NAME="test@localhost",
    )
    env.pop("REDIS_URL", None)
    log = (tmp_path / "worker.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.worker", "--without-mingle", "--without-gossip"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def queue(tmp_path: Path, run_id: int, config: dict, token: str) -> None:
    app = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path / "broker")})
    kwargs = {"run_id": run_id, "config": config, "token": token, "start_seq": 0, "resume_path": None}
    app.send_task(SUPERVISE_TASK, kwargs=kwargs, queue="cpu")


def test_stopping_the_worker_checkpoints_its_run_and_ships_the_end(
    fake_ingest, tiny_model_dir: Path, tmp_path: Path
) -> None:
    fake = fake_ingest(22)
    fake.rotate_tokens = True
    queue(tmp_path, 22, tiny_config(tiny_model_dir, total_steps=500), fake.valid_token)
    worker = start_worker_process(tmp_path, fake.url)
    registry = FileRegistry(tmp_path / "broker" / "workers")
    try:
        fake.wait_for(has_trained, timeout=120)
        # The worker is in the registry with what it has and the run it holds.
        (entry,) = registry.workers()
        assert entry.capabilities.name == "test@localhost" and entry.capabilities.queues == ["cpu"]
        assert entry.running == ["22"] and entry.capabilities.backends["torch"]
        worker.send_signal(signal.SIGTERM)  # what `manage.py serve` does on Ctrl-C
        assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()
        assert registry.workers() == []  # it said goodbye
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    events = read_log(tmp_path / "runs" / "22" / "events.jsonl")
    # On a mismatch, the worker's own account of the drain (its log) says why.
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:]
    assert fake.events() == events, (fake.summary(), len(events), worker_log)
    assert events[-1]["state"] == "cancelled" and fake.status == "cancelled"
    ckpt = [e for e in events if e["type"] == "checkpoint"][-1]
    assert Path(ckpt["path"]).is_dir()
    assert engine_processes(str(tmp_path / "runs" / "22")) == []


def test_an_engine_does_not_outlive_a_killed_worker(
    fake_ingest, tiny_model_dir: Path, tmp_path: Path
) -> None:
    fake = fake_ingest(23)
    queue(tmp_path, 23, tiny_config(tiny_model_dir, total_steps=500), fake.valid_token)
    worker = start_worker_process(tmp_path, fake.url)
    try:
        fake.wait_for(has_trained, timeout=120)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the worker's group; the engine has its own
        worker.wait()
    workdir = tmp_path / "runs" / "23"
    # The kernel tells the engine its supervisor is gone (SIGTERM): it checkpoints and stops.
    for _ in range(1200):
        if not engine_processes(str(workdir)):
            break
        time.sleep(0.1)
    assert engine_processes(str(workdir)) == []
    events = read_log(workdir / "events.jsonl")
    assert events[-1]["type"] == "status" and events[-1]["state"] == "cancelled"
    assert any(e["type"] == "checkpoint" for e in events), events[-6:]
    assert fake.status == "running"  # nobody told the web app: its sweeper marks the run lost
