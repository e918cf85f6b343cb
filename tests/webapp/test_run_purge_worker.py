"""Deleting a run whose files the web app cannot reach (no shared storage): the web app sends
``jobs.purge_run_files`` to the run's queue and a real worker process, on the broker this test
pass uses (the filesystem broker, or Redis in the PostgreSQL pass), removes the run's directory
from its own runs directory, and nothing else there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs.supervisor import RUNS_DIR_ENV
from webapp.runs import housekeeping
from webapp.runs.choices import RunStatus
from webapp.runs.models import Run

pytestmark = pytest.mark.slow


@pytest.fixture
def worker_runs(tmp_path: Path) -> Path:
    return tmp_path / "worker-runs"


@pytest.fixture
def queue_name() -> str:
    return f"purge-{uuid.uuid4().hex[:8]}"  # only this test's worker listens to it


@pytest.fixture
def worker(tmp_path: Path, worker_runs: Path, queue_name: str) -> Iterator[Path]:
    """A worker machine: the same broker as the web app, its own runs directory."""
    env = {
        **os.environ,
        "TRIBUTARY_QUEUES": queue_name,
        "TRIBUTARY_WORKER_NAME": f"{queue_name}@localhost",
        RUNS_DIR_ENV: str(worker_runs),
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobs.worker", "--without-mingle", "--without-gossip"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_worker_removes_the_files_the_web_app_cannot_reach(
    make_run: Callable[..., Run],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    worker_runs: Path,
    queue_name: str,
    worker: Path,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "web-runs"))  # the web app's own: empty
    run = make_run(name="remote", status=RunStatus.SUCCEEDED, queue=queue_name, worker_host="gpu-7")
    kept = make_run(name="kept", status=RunStatus.SUCCEEDED, queue=queue_name)
    for r in (run, kept):
        ckpt = worker_runs / str(r.pk) / "checkpoints" / "step_2"
        ckpt.mkdir(parents=True)
        (ckpt / "model.safetensors").write_bytes(b"\0" * 1024)

    with django_capture_on_commit_callbacks(execute=True):
        purged = housekeeping.delete_run(run, "remote")
    assert purged.files == f"sent to queue {queue_name}"
    assert not Run.objects.filter(pk=run.pk).exists()

    deadline = time.monotonic() + 180  # a worker's start takes a few seconds, more under load
    while (worker_runs / str(run.pk)).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = worker.read_text(errors="replace")
    assert not (worker_runs / str(run.pk)).exists(), log[-4000:]
    assert (worker_runs / str(kept.pk) / "checkpoints" / "step_2" / "model.safetensors").exists()
