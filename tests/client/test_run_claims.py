"""One script per run, against the real web app (uvicorn, SQLite, the real ingest socket).

Two scripts with one ``client_id`` (a run directory copied and resumed while its script runs)
would send the same seqs, and the web app keeps the first event of each: the second's events
were dropped while its user believed them stored. Now the second is refused at ``init`` with
``RunRefused`` naming the run, where the first reports from and the fix, having written and
shipped nothing, and every event of the first is stored. A script killed and restarted in its
own directory goes on with its run at once; a client of before claims ships as it did."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import tributary
from tests.client.test_run_server import SHIPPING, assert_stored_equals_log, client_run, train
from tests.conftest import REPO_ROOT
from tests.e2e.harness import WAIT, Deployment
from tributary.api import Api
from tributary.run import RunRefused
from tributary.shipper import EventShipper
from webapp.runs.external import HOLDER_SILENT_S

pytestmark = pytest.mark.slow

PROJECT = "faults"


def wait_acked(run: tributary.Run) -> None:
    from tests.e2e.harness import wait_until

    wait_until(lambda: run.acked_seq >= run.written_seq > 1, "the events written so far acked")


def test_a_copy_of_a_running_scripts_directory_is_refused_and_the_first_keeps_every_event(
    server: Deployment, tmp_path: Path
) -> None:
    first = client_run(server, tmp_path / "first")
    train(first, range(10))
    wait_acked(first)
    copy = tmp_path / "copy"  # the directory copied (to another host, here another path) and resumed
    shutil.copytree(tmp_path / "first", copy)
    held = (copy / "events.jsonl").read_bytes()
    with pytest.raises(RunRefused) as refused:
        tributary.init(project=PROJECT, url=server.url, token=server.api_token, resume=copy, drain_s=WAIT)
    said = str(refused.value)
    assert f"run {first.id} ('first')" in said and f"{socket.gethostname()} (pid" in said
    assert "new run" in said and "client_id" in said
    assert refused.value.run_id == first.id and refused.value.held_by == socket.gethostname()
    assert (copy / "events.jsonl").read_bytes() == held  # the refused script wrote nothing
    # The first script goes on, and everything it logged is stored: nothing was taken from the copy.
    train(first, range(10, 20))
    assert first.finish("succeeded")
    assert server.run(first.id)["status"] == "succeeded"
    assert_stored_equals_log(server, first.id, tmp_path / "first")
    # Its token renewed as the copy would ask: refused with where the first reports from.
    with pytest.raises(Exception) as renewal:
        Api(server.url, server.api_token).ingest_token(
            first.id, script={"claim": "0" * 32 + ".copy", "host": "gpu-copy", "pid": 1}
        )
    assert getattr(renewal.value, "held_by", None) is not None and getattr(renewal.value, "status", 0) == 409


def test_a_script_cut_off_while_a_copy_took_its_run_over_stops_and_the_copy_ships_on(
    server: Deployment, tmp_path: Path
) -> None:
    """The first script was silent for ``HOLDER_SILENT_S`` (cut off: here its last word is set
    back in the web app's database) but lives on with its socket open, and a copy of its
    directory took the run over. The first's next batch is refused (``CLOSE_CLAIM_LOST``): it
    raises ``RunRefused`` from its next logging call and asks training to stop; nothing it logged
    after the takeover is stored, and the run is exactly the copy's log."""
    # No pings from the first (each may move its last word to now): silent it stays, however long
    # the copy's init takes on a loaded machine.
    first = client_run(server, tmp_path / "first", shipper_options={**SHIPPING, "ping_interval": 3600.0})
    train(first, range(10))
    wait_acked(first)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "first", copy)
    then = (datetime.now(UTC) - timedelta(seconds=HOLDER_SILENT_S + 1)).strftime("%Y-%m-%d %H:%M:%S.%f")
    with sqlite3.connect(server.data / "tributary.sqlite3") as db:
        db.execute("UPDATE runs_run SET worker_seen_at = ?, heartbeat_at = ? WHERE id = ?", (then, then, first.id))
    taken = tributary.init(
        project=PROJECT, url=server.url, token=server.api_token, resume=copy, drain_s=WAIT, shipper_options=SHIPPING
    )
    assert taken.id == first.id
    deadline = time.monotonic() + WAIT
    with pytest.raises(RunRefused) as refused:
        for step in itertools.count(10):  # the first logs on until the web app's refusal reaches it
            assert time.monotonic() < deadline, "the first script was never refused"
            train(first, range(step, step + 1))
            time.sleep(0.05)
    assert "taken over by another copy" in str(refused.value) and f"run {first.id}" in str(refused.value)
    assert first.should_stop() and first.shipper is not None and first.shipper.claim_lost
    train(taken, range(10, 20))
    assert taken.finish("succeeded")
    assert server.run(first.id)["status"] == "succeeded"
    assert_stored_equals_log(server, first.id, copy)


def test_a_script_killed_and_restarted_in_its_directory_goes_on_with_its_run(
    server: Deployment, tmp_path: Path
) -> None:
    """Killed with SIGKILL while it was heard from a moment ago (the web app cannot tell it is
    gone): the same directory on the same host is the same script, restarted (the directory's
    lock says the other process ended), so it keeps the run and ships from the web app's ack."""
    directory = tmp_path / "killed"
    script = textwrap.dedent(
        f"""
        import os, signal, time, tributary
        run = tributary.init(project={PROJECT!r}, name="killed", url={server.url!r}, token={server.api_token!r},
                             dir={str(directory)!r}, shipper_options={SHIPPING!r})
        for step in range(10):
            run.log({{"reward/mean": step / 10}}, step=step)
        run.flush()
        deadline = time.monotonic() + 120
        while (run.id is None or run.acked_seq < run.written_seq) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(run.id, run.acked_seq, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=WAIT,
        check=False,
    )
    run_id, acked = map(int, done.stdout.split())
    assert done.returncode == -9 and acked == 11, done.stderr  # its running status + 10 metrics
    assert json.loads((directory / "run.json").read_text())["server_id"] == run_id
    restarted = tributary.init(
        project=PROJECT, url=server.url, token=server.api_token, resume=directory, drain_s=WAIT,
        shipper_options=SHIPPING,
    )  # fmt: skip
    assert restarted.id == run_id
    train(restarted, range(10, 20))
    assert restarted.finish("succeeded")
    assert restarted.shipper is not None and restarted.shipper.claim_lost == ""
    assert server.run(run_id)["status"] == "succeeded"
    assert_stored_equals_log(server, run_id, directory)


def test_a_client_of_before_claims_ships_as_before(server: Deployment, tmp_path: Path) -> None:
    """No claim anywhere (the API call, the token renewal, the socket's attach): no check."""
    directory = tmp_path / "old"
    offline = tributary.init(project=PROJECT, name="old", url="", token="", dir=directory)
    train(offline, range(8))
    assert not offline.finish("succeeded")
    meta = json.loads((directory / "run.json").read_text())
    api = Api(server.url, server.api_token)
    created = api.create_run(project=PROJECT, name="old", config={}, tags=[], client_id=meta["client_id"])
    again = api.ingest_token(created.id)  # the body of before: {}
    shipper = EventShipper(server.url, created.id, again.ingest_token, directory / "events.jsonl", **SHIPPING)
    assert shipper.claim is None
    shipper.start()
    assert shipper.finish(WAIT) and shipper.claim_lost == ""
    assert server.run(created.id)["status"] == "succeeded"
    # The events carry the client's id, not the server's: the web app stores them under the run.
    assert_stored_equals_log(server, created.id, directory)
