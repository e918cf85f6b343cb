"""Fault test: a worker killed mid-run, then the run resumed on the same machine.

The killed worker's engine is told by its launcher (PR_SET_PDEATHSIG) to stop: it finishes its
step, checkpoints and writes its final status, but nobody ships those events. The resume must
find them: the lost run's stored events become its engine's whole log, and the child starts
from that last checkpoint (numbered after its step), not from an older one the web app knew.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import assert_stored_matches, wait_until
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow


def test_a_resume_after_a_worker_kill_starts_from_the_engines_last_checkpoint(
    deployment, tiny_model_dir: Path
) -> None:
    # LOST_AFTER: long enough that a child whose engine is slow to start (a loaded machine) is not lost.
    d = deployment(LOST_AFTER="30", SWEEP_EVERY="1")
    ids = d.setup()
    d.start_web()
    first = d.start_worker()
    config = tiny_config(tiny_model_dir, total_steps=400, name="killed")
    config["checkpoint"] = {"every_steps": 2}
    run_id = d.api("POST", f"/projects/{ids['project']}/runs", {"config": config, "name": "killed"})["id"]
    wait_until(lambda: d.api("GET", f"/runs/{run_id}/checkpoints"), "a checkpoint stored", every=0.3)

    os.killpg(first.pid, signal.SIGKILL)  # the worker and its process group: the engine is orphaned
    first.wait(timeout=30)
    lost = d.wait_status(run_id, "lost")

    def engine_done() -> list[dict[str, Any]] | None:
        log = d.engine_log(run_id)
        return log if log[-1]["type"] == "status" and log[-1]["state"] in ("cancelled", "failed") else None

    log = wait_until(engine_done, "the orphaned engine to checkpoint and stop")
    last_checkpoint = [e for e in log if e["type"] == "checkpoint"][-1]
    assert lost["last_seq"] < last_checkpoint["seq"], "the test needs a checkpoint the worker never shipped"
    known = d.api("GET", f"/runs/{run_id}/checkpoints")[-1]
    assert known["step"] < last_checkpoint["step"]

    child_id = d.api("POST", f"/runs/{run_id}/resume", {})["id"]

    # The lost run's stored events are now its engine's whole log (its refused final status is
    # kept as a log line), its last checkpoint included.
    parent = d.run(run_id)
    assert parent["status"] == "lost" and parent["last_seq"] == log[-1]["seq"]
    assert_stored_matches(d.stored(run_id), log, log[-1]["seq"])
    assert d.api("GET", f"/runs/{run_id}/checkpoints")[-1]["step"] == last_checkpoint["step"]
    child = d.run(child_id)
    assert child["resume_from"]["step"] == last_checkpoint["step"]
    assert (child["last_seq"], child["last_step"]) == (0, last_checkpoint["step"])

    d.start_worker()
    wait_until(
        lambda: d.run(child_id)["last_step"] >= last_checkpoint["step"] + 2, "the child to train", every=0.3
    )
    d.api("POST", f"/runs/{child_id}/cancel")
    child = d.wait_status(child_id, "cancelled")
    child_log = d.engine_log(child_id)
    assert child["last_seq"] == child_log[-1]["seq"]
    assert_stored_matches(d.stored(child_id), child_log, child["last_seq"])
    steps = [e["step"] for e in child_log if e["type"] == "metrics"]
    assert steps[0] == last_checkpoint["step"] + 1, (steps[:3], last_checkpoint)
