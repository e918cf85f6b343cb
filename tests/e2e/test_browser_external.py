"""An external run's page (issue 17), in a real Chromium against the real web process and no
worker: the run is created through the API as a script would, and its events are shipped with
the client's own shipper (``tributary.shipper.EventShipper``) over the real ingest socket.

The open page must say, without a reload: that the run is external and waits for its script;
where the script reports from once it attaches (its host and pid); the run training; a Cancel
from the page reaching the script; and the run cancelled by the script's own final status, with
neither Resume nor Fork offered at any point. The runs table marks it "external". Screenshots
are kept in .cache/artifacts/screenshots; time limits only keep a broken build from hanging.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import NARROW, Site, no_errors, running_site, screenshot, text_of, watched_run_pages
from tests.e2e.harness import WAIT
from tests.e2e.test_browser_run_live import EngineLog
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

STAGE_MS = 30_000


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("external-site"), worker=False) as s:  # no worker at all
        yield s


def test_an_external_run_page_says_where_its_script_reports_from_and_follows_it(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "external-run"
    d = site.deployment
    created = d.api(
        "POST",
        "/runs/external",
        {
            "project": "faults",
            "name": "my-own-trainer",
            "config": {"model": "tiny", "optim": {"lr": 1e-5}},
            "tags": ["trl"],
            "client_id": str(uuid.uuid4()),
        },
    )
    run_id = created["id"]
    assert created["url"] == f"{d.url}/runs/{run_id}/"

    pages, contexts, consoles = watched_run_pages(browser, site, run_id)
    wide, narrow = pages
    for page in pages:
        assert text_of(page, "#run-external") == "external run · waiting for its script"
        assert text_of(page, "#run-external-badge") == "external"
        assert text_of(page, "#run-alert") == "waiting for its script to connect"
        assert page.locator("#cancel-button").is_visible()
        assert page.locator("#fork-link").count() == 0 and page.locator("#resume-form").count() == 0
        assert "Queue" not in text_of(page, ".run-facts")
    screenshot(wide, test, "waiting-1440")

    # The Config tab shows the script's own config, as it sent it (YAML).
    wide.click("#tab-config")
    assert text_of(wide, "#config-yaml") == "model: tiny\noptim:\n  lr: 1.0e-05"
    wide.click("#tab-charts")

    log = EngineLog(tmp_path / "events.jsonl", run_id)  # what the client library writes, shipped as it does
    write = log.write
    cancelled = threading.Event()
    shipper = EventShipper(
        d.url, run_id, created["ingest_token"], log.path,
        on_cancel=lambda message: cancelled.set(), backoff_base=0.1, backoff_cap=1.0,
    ).start()  # fmt: skip
    where = f"{socket.gethostname()} (pid {os.getpid()})"
    try:
        # The script attaches: the page says where it reports from, with no reload.
        for page in pages:
            page.wait_for_function(
                "(w) => document.querySelector('#run-external')?.textContent.trim() === w",
                arg=f"external run · reporting from {where}",
                timeout=STAGE_MS,
            )
            assert page.get_attribute("#run-header", "data-status") == "starting"
            assert text_of(page, "#run-worker") == socket.gethostname()
            assert text_of(page, "#run-pid") == f"(pid {os.getpid()})"
        screenshot(wide, test, "attached-1440")

        write("status", state="running", message="training with my own loop")
        for step in range(1, 6):
            write("metrics", step=step, time=time.time(), values={"reward/mean": step / 5})
        for page in pages:
            page.wait_for_selector("#run-header[data-status=running]", timeout=STAGE_MS)
            page.wait_for_function(
                "() => document.querySelector('#run-step')?.textContent === '5'", timeout=STAGE_MS
            )
            assert text_of(page, "#run-external") == f"external run · reporting from {where}"
            assert page.locator("#fork-link").count() == 0
        screenshot(wide, test, "running-1440")
        screenshot(narrow, test, "running-390")

        # Cancel on the page: the script hears it; the run stays running until its final status.
        wide.on("dialog", lambda dialog: dialog.accept())  # hx-confirm
        wide.click("#cancel-button")
        for page in pages:
            page.wait_for_selector("#run-cancelling", timeout=STAGE_MS)
            assert text_of(page, "#run-cancelling") == "Cancel requested: waiting for its script to stop."
            assert page.get_attribute("#run-header", "data-status") == "running"
        assert cancelled.wait(STAGE_MS / 1000), "the script never heard the cancel"

        write("status", state="cancelled", message="stopped by run.should_stop()")
        assert shipper.finish(timeout=WAIT), d.logs()
        for page in pages:
            page.wait_for_selector("#run-header[data-status=cancelled]", timeout=STAGE_MS)
            assert text_of(page, "#run-external") == f"external run · reported from {where}"
            assert page.locator("#resume-form").count() == 0 and page.locator("#fork-link").count() == 0
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
        screenshot(wide, test, "cancelled-1440")
        screenshot(narrow, test, "cancelled-390")
        width = narrow.evaluate("() => document.documentElement.scrollWidth")
        assert width <= NARROW["width"], f"the run page scrolls sideways at 390 px ({width} px wide)"

        # The runs table lists it like any run, marked external.
        wide.goto(f"{d.url}/projects/{site.project}/")
        row = wide.locator("tr", has_text="my-own-trainer")
        row.wait_for(timeout=STAGE_MS)
        assert row.locator(".run-origin").inner_text().strip() == "external"
        screenshot(wide, test, "runs-table-1440")
    finally:
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None and shipper.acked_seq == log.seq
    for console in consoles:
        no_errors(console)
