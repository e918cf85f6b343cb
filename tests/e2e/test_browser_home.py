"""The landing page follows its runs without a reload (issue 15), in a real Chromium against the
real web process (tests/e2e/browser.py).

This test is the run's worker, as in test_browser_run_live.py: it writes the engine's event log
and ships it with the worker's own ``EventShipper`` over the real ingest socket, so the state
changes reach the page exactly as a worker's would (the web process announces them on the
project socket; a process beside it could not: embedded mode's channel layer is in memory). Two
pages (1440 and 390 px wide) show a queued run among the active runs, then, with no reload, the
run training on its worker, then the run among the recent runs once it succeeds. Screenshots are
kept in .cache/artifacts/screenshots; time limits only keep a broken build from hanging.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.e2e.harness import WAIT
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

STAGE_MS = 20_000
HOST = "home-e2e-box"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("home-site"), worker=False) as s:  # this test is the worker
        yield s


def test_the_landing_page_moves_a_run_from_active_to_recent_without_a_reload(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "home"
    d = site.deployment
    name = "home-followed"
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": tiny_config(Path("unused"), 20, name=name), "name": name})["id"]  # fmt: skip
    active, recent = f"#active-run-{run_id}", f"#recent-run-{run_id}"

    pages, contexts, consoles = [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, "/")
        page.wait_for_selector("body[data-live-state=open]")
        assert page.inner_text(f"{active} [data-role=status-badge]") == "Queued"
        assert page.locator("#recent-empty").is_visible()
        fits = "el => el.scrollWidth <= el.parentElement.clientWidth"  # no sideways scroll in its card
        assert page.eval_on_selector("#active-runs-table", fits), f"the active runs overflow at {viewport['width']} px"
        page.evaluate("() => { window.notReloaded = true; }")  # a reload would drop it
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
        screenshot(page, test, f"queued-{viewport['width']}px")

    token = d.manage("shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))")
    events = tmp_path / "events.jsonl"
    seq = 0

    def write(kind: str, **fields: Any) -> None:
        nonlocal seq
        seq += 1
        with events.open("a") as fh:
            fh.write(json.dumps({"run": str(run_id), "seq": seq, "type": kind, **fields}) + "\n")

    events.write_text("")
    shipper = EventShipper(
        d.url, run_id, token.strip().splitlines()[-1], events, attach={"host": HOST}, backoff_base=0.1, backoff_cap=1.0
    ).start()
    try:
        write("status", state="starting", message="loading model and data")
        write("status", state="running", message="training on cpu")
        for page in pages:
            page.wait_for_selector(f"{active}[data-status=running]", timeout=STAGE_MS)
            assert page.inner_text(f"{active} [data-role=status-badge]") == "Running"
            assert page.locator(recent).count() == 0
        assert pages[0].inner_text(f"{active} .run-worker") == HOST
        screenshot(pages[0], test, "running-1440px")

        write("status", state="succeeded", message="done")
        assert shipper.finish(timeout=WAIT), d.logs()
        for page in pages:
            page.wait_for_selector(f"{recent}[data-status=succeeded]", timeout=STAGE_MS)
            assert page.locator(active).count() == 0
            assert page.locator("#active-empty").is_visible()
            assert page.inner_text(f"{recent} [data-role=status-badge]") == "Succeeded"
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
            width = page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= page.viewport_size["width"], f"the landing page scrolls sideways ({width} px wide)"
        for page, viewport in zip(pages, (WIDE, NARROW), strict=True):
            screenshot(page, test, f"finished-{viewport['width']}px")
    finally:
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None
    for console in consoles:
        no_errors(console)
