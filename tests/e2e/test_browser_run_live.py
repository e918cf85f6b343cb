"""An open run page follows its run without a reload (issue 15), in a real Chromium against the
real web process (tests/e2e/browser.py).

This test is the run's worker: it writes the engine's event log itself and ships it with the
worker's own ``EventShipper`` over the real ingest socket, so every state change reaches the
pages exactly as a worker's would, in seconds instead of a model's load time. Two pages watch
the run (1440 and 390 px wide); each must show, with no reload: the run starting and training,
the status line's step following the metrics, a cancel requested on one page taking the Cancel
button away on both, and the cancelled run offering Resume. Screenshots of each
stage are kept in .cache/artifacts/screenshots. Time limits only keep a broken build from
hanging.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    running_site,
    screenshot,
    signed_in_page,
    text_of,
    watched_run_pages,
)
from tests.e2e.harness import WAIT
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

TOTAL_STEPS = 300
STAGE_MS = 30_000


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("run-live-site"), worker=False) as s:  # this test is the worker
        yield s


class EngineLog:
    """The event log an engine would write for ``run_id``, appended to as the test goes."""

    def __init__(self, path: Path, run_id: int) -> None:
        self.path = path
        self.run = str(run_id)
        self.seq = 0
        path.write_text("")

    def write(self, kind: str, **fields: Any) -> None:
        self.seq += 1
        with self.path.open("a") as fh:
            fh.write(json.dumps({"run": self.run, "seq": self.seq, "type": kind, **fields}) + "\n")

    def steps(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            self.write("metrics", step=step, time=time.time(), values={"reward/mean": step / TOTAL_STEPS})


# The Checkpoints tab's rows as [step cell text, row class].
CHECKPOINT_ROWS = "() => [...document.querySelectorAll('#checkpoints tbody tr')].map(r => [r.cells[0].textContent, r.className])"


def test_an_open_run_page_follows_state_step_and_actions_without_a_reload(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "run-live"
    d = site.deployment
    config = tiny_config(Path("unused"), total_steps=TOTAL_STEPS, name="followed")
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": "followed"})["id"]

    pages, contexts, consoles = watched_run_pages(browser, site, run_id)
    wide, narrow = pages
    for page in pages:
        assert page.get_attribute("#run-header", "data-status") == "queued"
        assert page.locator("#cancel-button").is_visible()
        assert page.locator("#resume-form").count() == 0
    screenshot(wide, test, "queued-1440")

    token = d.manage(
        "shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))"
    )
    cancelled = threading.Event()
    log = EngineLog(tmp_path / "events.jsonl", run_id)
    shipper = EventShipper(
        d.url, run_id, token.strip().splitlines()[-1], log.path,
        on_cancel=lambda message: cancelled.set(), backoff_base=0.1, backoff_cap=1.0,
    ).start()  # fmt: skip
    try:
        # Starting, then training: the header is swapped in with the new state and the status
        # line counts the steps the metrics report.
        log.write("status", state="starting", message="loading model and data")
        log.write("status", state="running", message="training on cpu")
        log.steps(1, 10)
        for page in pages:
            page.wait_for_selector("#run-header[data-status=running]", timeout=STAGE_MS)
            page.wait_for_function(
                "() => document.querySelector('#run-alert [data-live-step]')?.textContent === '10'",
                timeout=STAGE_MS,
            )
            assert text_of(page, "#run-alert") == f"training on cpu · step 10 of {TOTAL_STEPS}"
            assert page.locator("#cancel-button").is_visible()
        log.write("checkpoint", step=10, path="checkpoints/step-10", bytes=2048, deleted=[])
        log.steps(11, 30)
        for page in pages:
            page.wait_for_function(
                "() => document.querySelector('#run-alert [data-live-step]')?.textContent === '30'",
                timeout=STAGE_MS,
            )
            assert text_of(page, "#run-step") == "30"
            assert text_of(page, "#run-alert") == f"training on cpu · step 30 of {TOTAL_STEPS}"
            assert page.evaluate(CHECKPOINT_ROWS) == [["10", ""]]
        screenshot(wide, test, "running-1440")
        screenshot(narrow, test, "running-390")

        # Cancel on the wide page (its header is swapped in place, no reload); the narrow page hears
        # of it from the socket: both drop the Cancel button and say the stop is coming.
        wide.on("dialog", lambda dialog: dialog.accept())  # hx-confirm
        wide.click("#cancel-button")
        for page in pages:
            page.wait_for_selector("#run-cancelling", timeout=STAGE_MS)
            assert page.locator("#cancel-button").count() == 0
            assert page.get_attribute("#run-header", "data-status") == "running"
        assert cancelled.wait(STAGE_MS / 1000), "the worker side never heard the cancel"
        screenshot(wide, test, "cancel-requested-1440")

        # The engine checkpoints and stops: Resume appears, the cancel note goes. The save deleted the
        # checkpoint of step 10 (keep_last 1): still listed, marked, not offered.
        log.write("checkpoint", step=30, path="checkpoints/step-30", bytes=4096, deleted=["checkpoints/step-10"])
        log.write("status", state="cancelled", message="stopped at step 30")
        assert shipper.finish(timeout=WAIT), d.logs()
        for page in pages:
            page.wait_for_selector("#run-header[data-status=cancelled]", timeout=STAGE_MS)
            page.wait_for_selector("#resume-button", timeout=STAGE_MS)
            assert page.locator("#run-cancelling").count() == 0
            assert page.locator("#cancel-button").count() == 0
            assert page.locator("#live-state").count() == 0
            assert page.locator("#run-alert [data-live-step]").count() == 0
            assert text_of(page, "#run-status") == "cancelled"
            options = page.inner_text("#resume-checkpoint")
            assert "step 30 (saved " in options and "step 10" not in options and "checkpoints/" not in options
            assert text_of(page, "#checkpoint-count") == "2"  # the tab
            assert page.evaluate(CHECKPOINT_ROWS) == [["10 (deleted)", "deleted"], ["30", ""]]
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
        screenshot(wide, test, "cancelled-1440")
        screenshot(narrow, test, "cancelled-390")
        width = narrow.evaluate("() => document.documentElement.scrollWidth")
        assert width <= NARROW["width"], f"the run page scrolls sideways at 390 px ({width} px wide)"
    finally:
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None and shipper.acked_seq == log.seq
    for console in consoles:
        assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())


def test_the_compare_button_opens_a_compare_page_that_adds_runs(site: Site, browser: Any) -> None:
    test = "run-live-compare"
    d = site.deployment
    ids = [
        d.api(
            "POST",
            f"/projects/{site.project}/runs",
            {"config": tiny_config(Path("unused"), 5, name=name), "name": name},
        )["id"]
        for name in ("first", "second")
    ]
    for viewport, label in ((WIDE, "1440"), (NARROW, "390")):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{ids[0]}/")
        page.click("#compare-link")
        page.wait_for_url(f"**/compare/?runs={ids[0]}")
        page.wait_for_selector("body[data-history-loaded]")
        assert page.locator("#compare-runs tbody tr").count() == 1
        assert page.locator("#compare-one").is_visible()
        screenshot(page, test, f"one-run-{label}")
        page.fill("#compare-search", "second")  # the server's search; added without a reload
        page.locator(f"#compare-results li[data-run-id='{ids[1]}'] button").click()
        page.wait_for_function(
            f"() => new URLSearchParams(location.search).get('runs') === '{ids[0]},{ids[1]}'"
        )
        page.wait_for_selector("body[data-history-loaded=true]")
        assert page.locator("#compare-runs tbody tr").count() == 2
        assert page.locator("#compare-one").count() == 0
        screenshot(page, test, f"two-runs-{label}")
        width = page.evaluate("() => document.documentElement.scrollWidth")
        context.close()
        assert width <= viewport["width"], (
            f"the compare page scrolls sideways at {viewport['width']} px ({width} px)"
        )
        assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())
