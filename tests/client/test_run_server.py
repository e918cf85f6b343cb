"""A client run against the real web app (uvicorn, SQLite, the real ingest socket): what the
database holds equals the local log; offline then ``sync`` (twice: nothing twice); the server
killed and restarted mid-run; Cancel reaching ``should_stop``."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tributary
from tests.conftest import REPO_ROOT
from tests.e2e.harness import WAIT, Deployment, free_port, wait_until
from tributary.run import Run

pytestmark = pytest.mark.slow

PROJECT = "faults"  # the harness's project slug
SHIPPING = {"backoff_base": 0.1, "backoff_cap": 1.0}  # reconnect soon after the restart: a short test


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    d = Deployment(tmp_path_factory.mktemp("client-site"))
    try:
        d.setup()
        d.start_web()
        yield d
    finally:
        d.stop_all()


def client_run(d: Deployment, directory: Path, **options: Any) -> Run:
    options.setdefault("shipper_options", SHIPPING)
    return tributary.init(
        project=PROJECT, name=directory.name, config={"lr": 1e-6, "model": {"path": "qwen"}}, tags=["client"],
        url=d.url, token=d.api_token, dir=directory, drain_s=WAIT, **options,
    )  # fmt: skip


def train(run: Run, steps: range) -> None:
    for step in steps:
        run.log(
            {
                "reward/mean": step / 10,
                "actor/entropy": 1.0 / (step + 1),
                "loss": float("nan") if step == 3 else 0.5,
            },
            step=step,
        )
        if step % 5 == 0:
            run.log_samples(
                [
                    {"prompt": f"q{step}", "completion": f"a{step}-{i}", "reward": float(i), "advantage": i - 0.5,
                     "length": 3 + i, "finish_reason": "stop", "components": {"acc": float(i)}, "group": step}
                    for i in range(2)
                ],
            )  # fmt: skip
            run.log_text(f"step {step} done", level="info")


def local_rows(directory: Path) -> dict[str, set[tuple[Any, ...]]]:
    """What the local log says the database must hold, row by row."""
    rows: dict[str, set[tuple[Any, ...]]] = {"metrics": set(), "samples": set(), "logs": set()}
    for line in (directory / "events.jsonl").read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event["type"] == "metrics":
            rows["metrics"] |= {
                (event["seq"], event["step"], k, v) for k, v in event["values"].items() if v is not None
            }
        elif event["type"] == "samples":
            rows["samples"] |= {
                (event["seq"], event["step"], i, s["prompt"], s["completion"], s["reward"], s["advantage"], s["length"],
                 s["finish_reason"], json.dumps(s["extra"], sort_keys=True))
                for i, s in enumerate(event["items"])
            }  # fmt: skip
        elif event["type"] == "log":
            rows["logs"].add((event["seq"], event["level"], event["message"]))
    return rows


def stored_rows(d: Deployment, run_id: int) -> dict[str, list[tuple[Any, ...]]]:
    """The rows the web app stored for the run (lists: a row stored twice would show twice)."""
    with sqlite3.connect(d.data / "tributary.sqlite3") as db:
        metrics = db.execute(
            "SELECT seq, step, name, value FROM runs_metricpoint WHERE run_id = ?", (run_id,)
        )
        samples = db.execute(
            "SELECT seq, step, \"index\", prompt, completion, reward, advantage, length, finish_reason, extra "
            "FROM runs_sample WHERE run_id = ?", (run_id,),
        )  # fmt: skip
        logs = db.execute("SELECT seq, level, message FROM runs_logline WHERE run_id = ?", (run_id,))
        return {
            "metrics": list(metrics),
            "samples": [(*row[:-1], json.dumps(json.loads(row[-1]), sort_keys=True)) for row in samples],
            "logs": list(logs),
        }


def assert_stored_equals_log(d: Deployment, run_id: int, directory: Path) -> None:
    want, got = local_rows(directory), stored_rows(d, run_id)
    for kind in ("metrics", "samples"):
        assert len(got[kind]) == len(set(got[kind])), f"{kind} stored twice"
        assert set(got[kind]) == want[kind], kind
    # Every log line of the script is stored once; the web app may add its own (status words).
    assert len(got["logs"]) == len(set(got["logs"]))
    assert want["logs"] <= set(got["logs"])


def test_a_client_run_stores_exactly_what_its_log_holds(site: Deployment, tmp_path: Path) -> None:
    run = client_run(site, tmp_path / "plain")
    train(run, range(30))
    assert run.finish("succeeded", "all done")
    assert run.id is not None and run.url and run.url.endswith(f"/{run.id}/")
    assert json.loads((tmp_path / "plain" / "run.json").read_text())["server_id"] == run.id
    served = site.run(run.id)
    assert served["status"] == "succeeded" and served["name"] == "plain"
    assert served["config"] == {"lr": 1e-6, "model": {"path": "qwen"}} and served["tags"] == ["client"]
    assert_stored_equals_log(site, run.id, tmp_path / "plain")


def test_a_run_written_while_no_server_listens_is_synced_once(site: Deployment, tmp_path: Path) -> None:
    directory = tmp_path / "offline"
    nobody = f"http://127.0.0.1:{free_port()}"  # no server there while the script runs
    run = tributary.init(
        project=PROJECT, name="offline", url=nobody, token=site.api_token, dir=directory, drain_s=2
    )
    train(run, range(12))
    assert not run.finish()
    assert run.id is None

    def sync() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tributary", "sync", str(directory), "--url", site.url, "--token", site.api_token],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=WAIT, check=False,
        )  # fmt: skip

    first = sync()
    assert first.returncode == 0, first.stdout + first.stderr
    run_id = json.loads((directory / "run.json").read_text())["server_id"]
    assert isinstance(run_id, int) and f"all {run.written_seq} events stored" in first.stdout
    assert site.run(run_id)["status"] == "succeeded"
    assert_stored_equals_log(site, run_id, directory)
    before = stored_rows(site, run_id)

    second = sync()  # the web app already holds it all: hello.last_seq says so, nothing is resent
    assert second.returncode == 0, second.stdout + second.stderr
    assert stored_rows(site, run_id) == before

    missing = subprocess.run(
        [sys.executable, "-m", "tributary", "sync", str(directory)], capture_output=True, text=True, cwd=REPO_ROOT,
        timeout=WAIT, check=False, env={k: v for k, v in os.environ.items() if not k.startswith("TRIBUTARY_")},
    )  # fmt: skip
    assert missing.returncode != 0 and "set TRIBUTARY_URL or pass --url" in missing.stderr


def test_the_server_killed_and_restarted_mid_run_loses_and_doubles_nothing(
    site: Deployment, tmp_path: Path
) -> None:
    directory = tmp_path / "restart"
    run = client_run(site, directory)
    train(run, range(10))
    wait_until(lambda: run.acked_seq >= run.written_seq > 1, "the first events acked")
    site.kill_web()
    train(run, range(10, 25))  # the server is down: the events wait on disk
    site.start_web()
    train(run, range(25, 40))
    assert run.finish()
    assert run.shipper is not None and run.shipper.connections >= 2  # it did lose the server and come back
    assert site.run(run.id)["status"] == "succeeded"
    assert_stored_equals_log(site, run.id, directory)


def test_cancel_on_the_server_reaches_should_stop(site: Deployment, tmp_path: Path) -> None:
    run = client_run(site, tmp_path / "cancel")
    run.log({"reward/mean": 0.0}, step=0)
    wait_until(
        lambda: run.id is not None and site.run(run.id)["status"] == "running", "the run to be running"
    )
    assert not run.should_stop()
    site.api("POST", f"/runs/{run.id}/cancel")
    step = 1
    while not run.should_stop():  # a training loop that checks the flag once per step
        run.log({"reward/mean": float(step)}, step=step)
        time.sleep(0.05)
        step += 1
        assert step < 10_000, "Cancel never reached the script"
    assert run.finish("cancelled", "stopped on request")
    assert site.wait_status(run.id, "cancelled")["status"] == "cancelled"
    assert_stored_equals_log(site, run.id, tmp_path / "cancel")


def test_a_run_ended_on_the_server_stops_the_script_and_offers_no_sync(
    site: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cancelled twice on the page (its script seemed gone), the run is over on the server: the
    script's next events are refused with 4410, should_stop() turns true, and finishing says they
    stay in the local log, never to send them with sync (which the server would refuse too)."""
    run = client_run(site, tmp_path / "ended")
    run.log({"reward/mean": 0.0}, step=0)
    wait_until(
        lambda: run.id is not None and site.run(run.id)["status"] == "running", "the run to be running"
    )
    site.api("POST", f"/runs/{run.id}/cancel")
    site.api("POST", f"/runs/{run.id}/cancel")
    assert site.run(run.id)["status"] == "cancelled"
    step = 1
    while not run.should_stop():
        run.log({"reward/mean": float(step)}, step=step)
        time.sleep(0.05)
        step += 1
        assert step < 10_000, "the script never heard that the run is over"
    assert not run.finish("cancelled")
    said = capsys.readouterr().err
    assert "will take no more events" in said and "tributary sync" not in said
    assert site.run(run.id)["status"] == "cancelled"


def test_a_token_refused_after_an_outage_is_renewed_through_the_api(tmp_path: Path) -> None:
    """The web app comes back refusing the ingest token the client holds (4401: it expired while
    the server was away, or, as here, the server's secret key was rotated meanwhile, which refuses
    it at once instead of after INGEST_TOKEN_MAX_AGE): the client asks the API for another (its
    personal API token is no signed value and still works) and ships the rest."""
    d = Deployment(tmp_path / "site")
    try:
        d.setup()
        d.start_web()
        run = client_run(d, tmp_path / "expired")
        train(run, range(5))
        wait_until(lambda: run.acked_seq >= run.written_seq > 1, "the first events acked")
        first = run.shipper
        d.kill_web()
        train(run, range(5, 10))
        d.env["SECRET_KEY"] = "rotated-" + "r" * 40  # every ingest token signed before is refused
        d.start_web()
        train(run, range(10, 15))
        assert run.finish()
        assert first is not None and first.error is not None and first.error.code == 4401
        assert run.shipper is not first
        assert_stored_equals_log(d, run.id, tmp_path / "expired")
    finally:
        d.stop_all()
