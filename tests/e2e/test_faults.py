"""Fault tests through real processes: the web app killed and restarted mid-run, and the
worker killed mid-run. The engine's own event log is the source of truth: afterwards the
events the web app stored are compared with it seq by seq (none missing, none twice), and a
browser following the run over its socket got every metric once, in order."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e.harness import Browser, assert_stored_matches, launch, wait_until
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow


def test_a_web_app_restart_mid_run_loses_nothing(deployment, tiny_model_dir: Path) -> None:
    d = deployment()
    ids = d.setup()
    d.start_web()
    d.start_worker()
    config = tiny_config(tiny_model_dir, total_steps=40, name="restart")
    run_id = launch(d, ids["project"], config)
    share = d.api("POST", f"/runs/{run_id}/shares")["token"]
    browser = Browser(d, run_id, share).start()

    wait_until(lambda: d.run(run_id)["last_step"] >= 5, "step 5 stored", every=0.3)
    d.kill_web()  # SIGKILL: no goodbye to the worker or the browser
    seen_before = browser.cursor
    d.start_web()  # same port, same database; the worker resends after the new hello
    run = d.wait_status(run_id, "succeeded", "failed")
    wait_until(lambda: browser.cursor >= run["last_seq"] or None, "the browser to catch up")
    browser.stop()

    assert run["status"] == "succeeded", d.logs()
    log = d.engine_log(run_id)
    assert run["last_seq"] == log[-1]["seq"]
    assert_stored_matches(d.stored(run_id), log, run["last_seq"])

    assert browser.connections >= 2 and 0 < seen_before < run["last_seq"]
    got = [e["seq"] for e in browser.events]
    assert got == sorted(set(got)), "the browser got an event twice or out of order"
    want_metrics = [e["seq"] for e in log if e["type"] == "metrics"]
    assert [e["seq"] for e in browser.events if e["type"] == "metrics"] == want_metrics


def test_a_killed_worker_is_lost_then_resumed_elsewhere(deployment, tiny_model_dir: Path) -> None:
    d = deployment(LOST_AFTER="5", SWEEP_EVERY="1")
    ids = d.setup()
    d.start_web()
    first = d.start_worker()
    config = tiny_config(tiny_model_dir, total_steps=400, name="killed")
    config["checkpoint"] = {"every_steps": 2}
    run_id = launch(d, ids["project"], config)

    wait_until(lambda: d.api("GET", f"/runs/{run_id}/checkpoints"), "a checkpoint stored", every=0.3)
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its whole process group: no goodbye
    first.wait(timeout=30)
    run = d.wait_status(run_id, "lost")
    assert "no word from worker" in run["status_message"]

    # What the web app stored is exactly the engine's log up to the stored cursor.
    log = d.engine_log(run_id)
    assert run["last_seq"] <= log[-1]["seq"]
    assert_stored_matches(d.stored(run_id), log, run["last_seq"])

    # Resume on another worker: a child run numbering its own events from 1, starting from the
    # newest checkpoint on disk (the orphaned engine checkpointed when its worker died, and
    # keep_last pruned older ones, maybe the one the web app knows), so its series continue
    # after the known checkpoint's step.
    d.api("PATCH", f"/runs/{run_id}", {"notes": "worker killed"})
    child_id = d.api("POST", f"/runs/{run_id}/resume", {})["id"]
    # The resume first stored what the dead worker never shipped (the runs directory is on this
    # machine): the newest checkpoint is now known, and the child starts from it.
    checkpoint = d.api("GET", f"/runs/{run_id}/checkpoints")[-1]
    child = d.run(child_id)
    assert (child["last_seq"], child["last_step"]) == (0, checkpoint["step"])
    d.start_worker()
    wait_until(lambda: d.run(child_id)["last_step"] >= checkpoint["step"] + 2, "the resumed run to train", every=0.3)
    d.api("POST", f"/runs/{child_id}/cancel")
    child = d.wait_status(child_id, "cancelled")
    child_log = d.engine_log(child_id)
    assert child_log[0]["seq"] == 1
    assert child["last_seq"] == child_log[-1]["seq"]
    assert_stored_matches(d.stored(child_id), child_log, child["last_seq"])
    steps = [e["step"] for e in child_log if e["type"] == "metrics"]
    assert steps and min(steps) > checkpoint["step"]
