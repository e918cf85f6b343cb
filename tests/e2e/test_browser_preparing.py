"""What a page says is always true, live (issue 15), in a real Chromium against the real web process:
a run page shows each preparing phase of its run as it happens and then its steps, and the landing
page's list of active runs moves each run's step without reading the lists again.

This test is the run's worker, as in test_browser_run_live.py: it writes the event log through the
engine's own ``EventSink`` and ``Phases`` (the starter policy is really built, with a recipe small
enough for a test) and ships it with the worker's ``EventShipper`` over the real ingest socket.
Pages at 1440 and 390 px; screenshots in .cache/artifacts/screenshots; time limits only keep a
broken build from hanging.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.models.starter import StarterRecipe, build_starter
from engine.phases import Phases, model_files
from jobs.supervisor import ENGINE_STARTING
from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.e2e.harness import WAIT
from tests.tiny_runs import tiny_config
from tributary.events import EventSink
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

STAGE_MS = 30_000
HOST = "prep-e2e-box"
TOTAL = 20
# Every text the status line shows, in order (the header is swapped in after each change).
RECORD_ALERTS = """() => {
  window.alerts = [];
  setInterval(() => {
    const el = document.getElementById("run-alert");
    const text = el && !el.hidden ? el.textContent.trim() : "";
    if (text && text !== window.alerts[window.alerts.length - 1]) window.alerts.push(text);
  }, 40);
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(
        tmp_path_factory.mktemp("preparing-site"), worker=False
    ) as s:  # this test is the worker
        yield s


def ship(site: Site, run_id: int, events: Path) -> EventShipper:
    d = site.deployment
    token = d.manage(
        "shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))"
    )
    return EventShipper(
        d.url, run_id, token.strip().splitlines()[-1], events, attach={"host": HOST}, backoff_base=0.1, backoff_cap=1.0
    ).start()  # fmt: skip


def alert_is(page: Any, pattern: str) -> None:
    """Wait until the status line matches ``pattern`` (a regular expression, whole text)."""
    page.wait_for_function(
        "(p) => new RegExp('^' + p + '$').test(document.getElementById('run-alert')?.textContent.trim() || '')",
        arg=pattern,
        timeout=STAGE_MS,
    )


def test_a_run_page_shows_each_preparing_phase_then_the_steps(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "preparing"
    d = site.deployment
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": tiny_config(Path("unused"), TOTAL, name="prep"), "name": "prep"})["id"]  # fmt: skip
    pages, contexts, consoles = [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")
        page.wait_for_selector("#live-state[data-state=open]")
        page.evaluate(RECORD_ALERTS)
        page.evaluate("() => { window.notReloaded = true; }")
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
    for page in pages:  # no worker is online, and the page says so
        alert_is(page, re.escape("Waiting for a worker: none is online.") + ".*")
    screenshot(pages[0], test, "queued-1440")

    events = tmp_path / "events.jsonl"
    events.write_text("")
    shipper = ship(site, run_id, events)
    sink = EventSink(str(run_id), events)
    try:
        taken = f"worker {HOST} took the run: starting the engine"
        for page in pages:
            alert_is(page, re.escape(taken))
        sink.status("starting", ENGINE_STARTING)  # what the supervisor writes before the engine exists
        for page in pages:
            alert_is(page, re.escape(ENGINE_STARTING))

        # A real build of a starter policy (tiny recipe), its progress through the engine's phases.
        phases = Phases(sink, every=0.5)
        report = phases.starter("arithmetic", 1, 0.4)
        recipe = StarterRecipe(size="tiny", max_steps=8, eval_every=4, val_size=16, target_accuracy=1.1)
        build_starter(tmp_path / "starter", "arithmetic", 1, recipe=recipe, progress=report)
        building = re.escape(
            "building the starter policy for arithmetic (difficulty 1, first use): 8/8 steps, "
        )
        for page in pages:
            alert_is(page, building + r"\d+% accuracy \(done at 40%\)")
        screenshot(pages[0], test, "starter-1440")
        screenshot(pages[1], test, "starter-390")
        for page in pages:
            assert page.get_attribute("#run-header", "data-status") == "starting"
            assert page.inner_text("#run-worker") == HOST

        loading = f"loading the model ({model_files(tmp_path / 'starter')}) on cpu"
        phases(loading)
        for page in pages:
            alert_is(page, re.escape(loading))
        screenshot(pages[1], test, "loading-390")

        sink.status("running", "training on cpu")
        for step in range(1, 6):
            sink.metrics(step, {"reward/mean": step / TOTAL})
        for page in pages:
            page.wait_for_selector("#run-header[data-status=running]", timeout=STAGE_MS)
            alert_is(page, re.escape(f"training on cpu · step 5 of {TOTAL}"))
        for step in range(6, 13):
            sink.metrics(step, {"reward/mean": step / TOTAL})
        for page in pages:  # the status line and the header agree, step by step
            alert_is(page, re.escape(f"training on cpu · step 12 of {TOTAL}"))
            assert page.inner_text("#run-step") == "12"
        run = d.run(run_id)
        assert (run["status_message"], run["last_step"]) == ("training on cpu", 12)  # the API agrees
        screenshot(pages[0], test, "running-1440")
        screenshot(pages[1], test, "running-390")

        for page in pages:
            seen = page.evaluate("() => window.alerts")
            # Every phase was shown, in the order it happened (none skipped, none out of order).
            expected = [taken, ENGINE_STARTING, "building the starter policy", loading, "training on cpu"]
            positions = [next(i for i, text in enumerate(seen) if text.startswith(e)) for e in expected]
            assert positions == sorted(positions), seen
            assert not any("Waiting for a worker" in text for text in seen[positions[0] :]), seen
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
        sink.status("succeeded", "finished 12 steps")
        assert shipper.finish(timeout=WAIT), d.logs()
    finally:
        sink.close()
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None
    for console in consoles:
        no_errors(console)


def test_the_landing_page_moves_each_runs_step_live_without_reading_the_lists(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "home-steps"
    d = site.deployment
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": tiny_config(Path("unused"), 40, name="stepping"), "name": "stepping"})["id"]  # fmt: skip
    step_cell = f"#active-run-{run_id} [data-role=last-step]"
    pages, contexts, consoles, reads = [], [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, "/")
        page.wait_for_selector("body[data-live-state=open]")
        page.evaluate(
            """(sel) => { window.steps = []; setInterval(() => {
                 const t = document.querySelector(sel)?.textContent;
                 if (t && t !== window.steps[window.steps.length - 1]) window.steps.push(t); }, 40); }""",
            step_cell,
        )
        page.evaluate("() => { window.notReloaded = true; }")
        page_reads: list[str] = []
        page.on("request", lambda r, out=page_reads: out.append(r.url) if "/home/runs" in r.url else None)
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
        reads.append(page_reads)

    events = tmp_path / "events.jsonl"
    events.write_text("")
    shipper = ship(site, run_id, events)
    sink = EventSink(str(run_id), events)
    try:
        sink.status("starting", "preparing the run")
        sink.status("running", "training on cpu")
        for page in pages:
            page.wait_for_selector(f"#active-run-{run_id}[data-status=running]", timeout=STAGE_MS)
        before = [len(r) for r in reads]
        for step in range(1, 31):  # ~3 s of steps: several throttled updates, the last one sent
            sink.metrics(step, {"reward/mean": step / 40})
            time.sleep(0.1)
        for page in pages:
            page.wait_for_function(
                "(sel) => document.querySelector(sel)?.textContent === '30'", arg=step_cell, timeout=STAGE_MS
            )
            assert page.inner_text(f"#active-run-{run_id} .run-step") == "30 / 40"
            steps = [int(s) for s in page.evaluate("() => window.steps")]
            assert steps == sorted(steps) and len([s for s in steps if 0 < s < 30]) >= 1, steps  # it moved
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
        # The steps came on the socket: the lists were not read again for them (one read may be
        # the running status's, still on its way when the count was taken).
        assert all(len(r) - b <= 1 for r, b in zip(reads, before, strict=True)), (before, reads)
        screenshot(pages[0], test, "stepping-1440")
        screenshot(pages[1], test, "stepping-390")
        sink.status("succeeded", "finished 30 steps")
        assert shipper.finish(timeout=WAIT), d.logs()
        for page in pages:
            page.wait_for_selector(f"#recent-run-{run_id}[data-status=succeeded]", timeout=STAGE_MS)
    finally:
        sink.close()
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None
    for console in consoles:
        no_errors(console)
