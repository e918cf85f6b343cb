"""Fault tests through real processes: the web app killed and restarted mid-run, and the
worker killed mid-run, then its run resumed (the same run, its next attempt) on the same machine. The engine's own event log is
the source of truth: afterwards the events the web app stored are compared with it seq by seq
(none missing, none twice), and a browser following the run over its socket got every metric
once, in order."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

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


def test_a_killed_worker_is_lost_then_resumed_from_the_engines_last_checkpoint(
    deployment, tiny_model_dir: Path
) -> None:
    """The killed worker's engine is told by its launcher (PR_SET_PDEATHSIG) to stop: it finishes
    its step, checkpoints and writes its final status, but nobody ships those events. The resume
    must find them: the lost run's stored events become its engine's whole log, and its next
    attempt starts from that last checkpoint (numbered after its step), not from an older one
    the web app knew."""
    # LOST_AFTER: short, so the killed run is lost soon, yet long enough that its next attempt,
    # whose engine may be slow to start on a loaded machine, is not (a starting run gets 10 x LOST_AFTER).
    d = deployment(LOST_AFTER="10", SWEEP_EVERY="1")
    ids = d.setup()
    d.start_web()
    first = d.start_worker()
    config = tiny_config(tiny_model_dir, total_steps=400, name="killed")
    config["checkpoint"] = {"every_steps": 2}
    run_id = launch(d, ids["project"], config)

    wait_until(lambda: d.api("GET", f"/runs/{run_id}/checkpoints"), "a checkpoint stored", every=0.3)
    os.killpg(first.pid, signal.SIGKILL)  # the worker and its whole process group: no goodbye
    first.wait(timeout=30)
    lost = d.wait_status(run_id, "lost")
    assert "no word from worker" in lost["status_message"]

    # What the web app stored is exactly the engine's log up to the stored cursor.
    log = d.engine_log(run_id)
    assert lost["last_seq"] <= log[-1]["seq"]
    assert_stored_matches(d.stored(run_id), log, lost["last_seq"])

    def engine_done() -> list[dict[str, Any]] | None:
        log = d.engine_log(run_id)
        return log if log[-1]["type"] == "status" and log[-1]["state"] in ("cancelled", "failed") else None

    log = wait_until(engine_done, "the orphaned engine to checkpoint and stop")
    last_checkpoint = [e for e in log if e["type"] == "checkpoint"][-1]
    assert lost["last_seq"] < last_checkpoint["seq"], "the test needs a checkpoint the worker never shipped"
    known = d.api("GET", f"/runs/{run_id}/checkpoints")[-1]
    assert known["step"] < last_checkpoint["step"]

    d.api("PATCH", f"/runs/{run_id}", {"notes": "worker killed"})
    resumed = d.api("POST", f"/runs/{run_id}/resume", {})
    assert resumed["id"] == run_id  # the same run continues (one URL, one history)

    # The lost run's stored events are now its engine's whole log (its refused final status is
    # kept as a log line), its last checkpoint included (the runs directory is on this machine).
    run = d.run(run_id)
    assert run["status"] == "queued" and run["last_seq"] == log[-1]["seq"]
    assert_stored_matches(d.stored(run_id), log, log[-1]["seq"])
    assert d.api("GET", f"/runs/{run_id}/checkpoints")[-1]["step"] == last_checkpoint["step"]
    # Resumed on another worker: the next attempt of the run, from that checkpoint, its engine
    # numbering its events after the stored ones in the same run directory.
    assert run["resume_from"]["step"] == last_checkpoint["step"]
    assert [(a["number"], a["status"], a["from_step"]) for a in run["attempts"]] == [
        (1, "lost", None),
        (2, "", last_checkpoint["step"]),
    ]
    d.start_worker()

    def trained() -> bool | None:
        run = d.run(run_id)
        return (
            run["attempts"][-1]["first_step"] is not None and run["last_step"] >= last_checkpoint["step"] + 2
        ) or None

    wait_until(trained, "the resumed run to train", every=0.3)
    d.api("POST", f"/runs/{run_id}/cancel")
    run = d.wait_status(run_id, "cancelled")
    whole = d.engine_log(run_id)
    assert [e["seq"] for e in whole] == list(range(1, len(whole) + 1)), "one chain of seqs over both attempts"
    assert run["last_seq"] == whole[-1]["seq"]
    assert_stored_matches(d.stored(run_id), whole, run["last_seq"])
    steps = [e["step"] for e in whole[len(log) :] if e["type"] == "metrics"]
    assert steps[0] == last_checkpoint["step"] + 1, (steps[:3], last_checkpoint)
    assert min(steps) > last_checkpoint["step"], steps
    # One chart from step 0: every step once, nothing superseded (it resumed from its last step).
    series = d.api("GET", f"/runs/{run_id}/metrics/series?max_points=20000&names=reward/mean")["series"][0]
    assert series["step"] == list(range(1, run["last_step"] + 1))
