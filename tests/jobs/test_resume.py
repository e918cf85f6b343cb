"""A resume continues the same run, through the real web app (uvicorn; SQLite, then PostgreSQL)
and real supervisors running real engines in one run directory: a run cancelled mid-training and
resumed goes on under the same id, its engine numbering its events after the stored ones, and
what the web app stored is its engine log (both attempts, one file) seq by seq. A resume from an
older checkpoint rewinds: the chart goes on from that checkpoint, the left branch kept aside.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from jobs.supervisor import RUNS_DIR_ENV, RunResult, RunSupervisor
from tests.e2e.harness import Deployment, assert_stored_matches, wait_until
from tests.jobs import test_claim
from tests.jobs.test_claim import launch, messages, stored
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow

web = test_claim.web  # the web app on SQLite, then on PostgreSQL (a deployment of this module's own)


class Attempt:
    """The supervisor of the run's latest queue message, run in a thread as a worker's task does."""

    def __init__(self, d: Deployment, run_id: int) -> None:
        kwargs = messages(d, run_id)[-1]
        self.kwargs = kwargs
        self.supervisor = RunSupervisor(
            run_id,
            kwargs["config"],
            kwargs["token"],
            start_seq=kwargs["start_seq"],
            resume_path=kwargs["resume_path"],
            web_url=d.url,
            connect_timeout=120,
            drain_timeout=120,
        )
        self.results: list[RunResult] = []
        self.thread = threading.Thread(target=lambda: self.results.append(self.supervisor.run()), daemon=True)
        self.thread.start()

    def result(self) -> RunResult:
        self.thread.join(300)
        assert self.results, "the supervisor did not finish"
        return self.results[0]


def train_then_cancel(d: Deployment, run_id: int, past_step: int) -> RunResult:
    attempt = Attempt(d, run_id)

    def trained() -> (
        bool | None
    ):  # by this attempt: after a rewind, the run's last step is the old one at first
        run = d.run(run_id)
        return (run["attempts"][-1]["first_step"] is not None and run["last_step"] >= past_step) or None

    wait_until(trained, f"step {past_step} stored", every=0.3)
    d.api("POST", f"/runs/{run_id}/cancel")
    result = attempt.result()
    assert (result.state, result.drained) == ("cancelled", True), result
    d.wait_status(run_id, "cancelled")
    return result


def series(d: Deployment, run_id: int, *, superseded: bool = False) -> dict[str, Any]:
    query = "max_points=5000&names=reward/mean" + ("&superseded=true" if superseded else "")
    return d.api("GET", f"/runs/{run_id}/metrics/series?{query}")["series"][0]


def test_a_cancelled_run_resumed_continues_in_the_same_run(
    web: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, project = web
    monkeypatch.setenv(RUNS_DIR_ENV, str(d.data / "runs"))
    config = tiny_config(tiny_model_dir, total_steps=400, name="resumed")
    config["checkpoint"] = {"every_steps": 2}
    run_id = launch(d, project, config)
    train_then_cancel(d, run_id, 3)
    first = d.run(run_id)

    resumed = d.api("POST", f"/runs/{run_id}/resume", {})
    assert resumed["id"] == run_id and resumed["status"] == "queued"
    message = messages(d, run_id)[-1]
    assert message["start_seq"] == first["last_seq"] and message["resume_path"]
    train_then_cancel(d, run_id, first["last_step"] + 2)

    run = d.run(run_id)
    log = d.engine_log(run_id)
    # One run directory, one log, one chain of seqs across both attempts; stored = logged.
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert run["last_seq"] == log[-1]["seq"]
    assert_stored_matches(stored(d, run_id), log, run["last_seq"])
    attempts = run["attempts"]
    assert [(a["number"], a["status"]) for a in attempts] == [(1, "cancelled"), (2, "cancelled")]
    assert (
        attempts[1]["first_seq"] == attempts[0]["last_seq"] + 1 and attempts[1]["last_seq"] == log[-1]["seq"]
    )
    assert all(a["worker_host"] and a["started_at"] and a["ended_at"] for a in attempts)
    # The engine took up the run at the checkpoint it saved when cancelled (its last step), so
    # one continuous chart: every step from 1 once, nothing superseded.
    assert attempts[1]["from_step"] == first["last_step"] == attempts[1]["first_step"] - 1
    steps = series(d, run_id)["step"]
    assert steps == list(range(1, run["last_step"] + 1))
    assert series(d, run_id, superseded=True)["step"] == []


def test_a_resume_from_an_older_checkpoint_rewinds_the_chart(
    web: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, project = web
    monkeypatch.setenv(RUNS_DIR_ENV, str(d.data / "runs"))
    config = tiny_config(tiny_model_dir, total_steps=400, name="rewound")
    # Every checkpoint kept: the engine may run tens of steps past step 6 before the cancel lands (a
    # fast machine did: step 24, pruning step 2 with keep_last 10, and the resume from it then failed).
    config["checkpoint"] = {"every_steps": 2, "keep_last": 200}
    run_id = launch(d, project, config)
    train_then_cancel(d, run_id, 6)
    first = d.run(run_id)
    older = next(c for c in d.api("GET", f"/runs/{run_id}/checkpoints") if c["step"] == 2)

    d.api("POST", f"/runs/{run_id}/resume", {"checkpoint_id": older["id"]})
    assert messages(d, run_id)[-1]["resume_path"] == older["path"]
    train_then_cancel(d, run_id, 4)

    run = d.run(run_id)
    log = d.engine_log(run_id)
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert_stored_matches(stored(d, run_id), log, run["last_seq"])
    second = [e for e in log if e["seq"] > first["last_seq"]]
    assert next(e["step"] for e in second if e["type"] == "metrics") == 3
    # The chart: steps 1..last once each, 3 and on from the second attempt; the first attempt's
    # steps 3..its last kept aside.
    steps = series(d, run_id)["step"]
    assert steps == list(range(1, run["last_step"] + 1))
    assert series(d, run_id, superseded=True)["step"] == list(range(3, first["last_step"] + 1))
    assert run["attempts"][1]["from_step"] == 2 and run["attempts"][1]["first_step"] == 3
    # The left branch's checkpoints are not offered again; on disk, the new branch's replaced them.
    checkpoints = d.api("GET", f"/runs/{run_id}/checkpoints")
    left = [c["step"] for c in checkpoints if c["superseded"]]
    assert left and min(left) > 2 and all(c["attempt"] == 1 for c in checkpoints if c["superseded"])
    on_disk = sorted(p.name for p in (d.data / "runs" / str(run_id) / "checkpoints").glob("step_*"))
    assert max(on_disk) == f"step_{run['last_step']:06d}", on_disk
