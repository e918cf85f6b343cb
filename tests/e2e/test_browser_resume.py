"""A resume continues the same run, seen from open run pages (issue 15), in a real Chromium against
the real web process (tests/e2e/browser.py).

As in test_browser_run_live.py, this test is the run's worker: it writes the engine's event log
(one file for every attempt, as a worker's run directory holds it, seqs going on) and ships it
with the worker's own ``EventShipper`` under each attempt's ingest token. Two pages (1440 and
390 px) stay open throughout, never reloaded, and must show: the run cancelled; a Resume on one
page making the same run queued again on both, its attempts list growing; the chart going on
from the checkpoint with every step once; then a resume from an older checkpoint (a rewind)
drawing the new branch past the branch point, the superseded points hidden until the toggle
shows them faded. Screenshots in .cache/artifacts/screenshots.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    no_errors,
    running_site,
    screenshot,
    signed_in_page,
    wait_held,
)
from tests.e2e.harness import WAIT
from tests.e2e.test_browser_run_live import EngineLog
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper

pytestmark = pytest.mark.slow

TOTAL_STEPS = 300
STAGE_MS = 30_000
SERIES = "() => { const s = window.tributaryCharts.store.byKey('0|reward/mean'); return s ? s.step : []; }"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("resume-site"), worker=False) as s:  # this test is the worker
        yield s


def ship_attempt(site: Site, run_id: int, log: EngineLog, write: Any) -> EventShipper:
    """The current attempt's worker: its token, then ``write(log)``, shipped until acknowledged."""
    d = site.deployment
    out = d.manage(
        "shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))"
    )
    shipper = EventShipper(
        d.url, run_id, out.strip().splitlines()[-1], log.path, backoff_base=0.1, backoff_cap=1.0
    ).start()
    try:
        write(log)
        assert shipper.finish(timeout=WAIT), d.logs()
    finally:
        shipper.stop()
    assert shipper.error is None and shipper.acked_seq == log.seq
    return shipper


def attempt(first: int, last: int, checkpoints: tuple[int, ...]) -> Any:
    def write(log: EngineLog) -> None:
        log.write("status", state="starting", message="loading model and data")
        log.write("status", state="running", message="training on cpu")
        for step in range(first, last + 1):
            log.steps(step, step)
            if step in checkpoints:
                log.write("checkpoint", step=step, path=f"checkpoints/step_{step:06d}", bytes=4096)
        log.write("status", state="cancelled", message=f"stopped at step {last}")

    return write


def a_run_page(site: Site, browser: Any, name: str) -> tuple[int, Any, Any, Any]:
    """A new run called ``name`` and a wide page signed in on it: (run id, context, page, console)."""
    config = tiny_config(Path("unused"), total_steps=TOTAL_STEPS, name=name)
    run_id = site.deployment.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": name})["id"]
    return (run_id, *signed_in_page(browser, site, "e2e", WIDE, f"/runs/{run_id}/"))


def wait_steps(page: Any, steps: list[int]) -> None:
    """Until the page's reward series holds exactly these steps, in order (no gap, none twice)."""
    want = json.dumps(steps, separators=(",", ":"))
    page.wait_for_function(f"() => JSON.stringify(({SERIES})()) === '{want}'", timeout=STAGE_MS)


def resume_from(page: Any, step: int) -> None:
    value = page.evaluate(
        "(step) => [...document.querySelectorAll('#resume-checkpoint option')]"
        ".find((o) => o.textContent.startsWith(`step ${step} `)).value",
        step,
    )
    page.select_option("#resume-checkpoint", value)
    page.click("#resume-button")


def test_an_open_run_page_sees_a_resume_continue_the_run_and_a_rewind_branch_it(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "resume"
    d = site.deployment
    config = tiny_config(Path("unused"), total_steps=TOTAL_STEPS, name="resumed")
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": "resumed"})["id"]
    url = f"/runs/{run_id}/"

    pages, contexts, consoles = [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, url)
        page.wait_for_selector("body[data-history-loaded]")
        page.evaluate("() => { window.notReloaded = true; }")  # a reload would drop it
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
    wide, narrow = pages
    try:
        log = EngineLog(tmp_path / "events.jsonl", run_id)
        # Attempt 1: steps 1..30, checkpoints at 10, 20, 30, cancelled.
        ship_attempt(site, run_id, log, attempt(1, 30, (10, 20, 30)))
        for page in pages:
            page.wait_for_selector("#run-header[data-status=cancelled]", timeout=STAGE_MS)
            page.wait_for_selector("#resume-button", timeout=STAGE_MS)
            wait_steps(page, list(range(1, 31)))
            assert page.get_attribute("#run-attempts", "data-count") == "1"
        options = wide.eval_on_selector_all("#resume-checkpoint option", "os => os.map((o) => o.textContent)")
        assert options[0] == "latest checkpoint" and [o.split(" ")[1] for o in options[1:]] == [
            "30",
            "20",
            "10",
        ]
        screenshot(wide, test, "cancelled-1440")

        # Resume from the latest on the wide page: the same run is queued again on both pages.
        resume_from(wide, 30)
        for page in pages:
            page.wait_for_selector("#run-header[data-status=queued]", timeout=STAGE_MS)
            page.wait_for_selector("#run-attempts[data-count='2']", timeout=STAGE_MS)
            assert "from the checkpoint of step 30" in page.inner_text("#attempt-list li[data-attempt='2']")
            assert page.locator("#cancel-button").is_visible()
        screenshot(narrow, test, "resumed-queued-390")

        # Attempt 2 (its own token; the events go on after seq of attempt 1): steps 31..40.
        ship_attempt(site, run_id, log, attempt(31, 40, (40,)))
        for page in pages:
            page.wait_for_selector("#run-header[data-status=cancelled]", timeout=STAGE_MS)
            wait_steps(page, list(range(1, 41)))  # one chart, no gap, no point twice
            page.wait_for_selector(
                "#attempt-list li[data-attempt='2'][data-status=cancelled]", timeout=STAGE_MS
            )
            assert page.url.endswith(url)
        wide.wait_for_function("() => window.tributaryCharts.pointCount() === 40", timeout=STAGE_MS)
        screenshot(wide, test, "resumed-continued-1440")
        screenshot(narrow, test, "resumed-continued-390")

        # A rewind: resume from step 20. Attempt 3 logs steps 21..25: the charts show 1..25, the
        # superseded 21..40 hidden until the toggle draws them faded.
        resume_from(narrow, 20)
        for page in pages:
            page.wait_for_selector("#run-attempts[data-count='3']", timeout=STAGE_MS)
        ship_attempt(site, run_id, log, attempt(21, 25, ()))
        for page in pages:
            wait_steps(page, list(range(1, 26)))
            page.wait_for_selector("#superseded-toggle:not([hidden])", timeout=STAGE_MS)
            page.locator("#charts").scroll_into_view_if_needed()  # panels off screen are drawn when seen
            page.wait_for_function("() => window.tributaryCharts.pointCount() === 25", timeout=STAGE_MS)
            assert page.evaluate("() => window.tributaryCharts.supersededCount()") == 0
            page.wait_for_function(
                "() => document.querySelector('#run-step').textContent === '25'", timeout=STAGE_MS
            )
        screenshot(wide, test, "rewound-1440")
        for page in pages:
            page.check("#show-superseded")
            page.locator("#charts").scroll_into_view_if_needed()
            # Attempt 1's steps 21..30 and attempt 2's 31..40, drawn faded; the history's count stays.
            page.wait_for_function("() => window.tributaryCharts.supersededCount() === 20", timeout=STAGE_MS)
            assert page.evaluate("() => window.tributaryCharts.pointCount()") == 25
        screenshot(wide, test, "rewound-superseded-1440")
        screenshot(narrow, test, "rewound-superseded-390")
        wide.uncheck("#show-superseded")
        wide.wait_for_function("() => window.tributaryCharts.supersededCount() === 0", timeout=STAGE_MS)

        # A page opened now draws the same: the history without the superseded points.
        context, fresh, console = signed_in_page(browser, site, "e2e", NARROW, url)
        contexts.append(context)
        consoles.append(console)
        fresh.wait_for_selector("body[data-history-loaded]")
        wait_steps(fresh, list(range(1, 26)))
        assert fresh.is_visible("#superseded-toggle")
        fresh.check("#show-superseded")
        fresh.locator("#charts").scroll_into_view_if_needed()
        fresh.wait_for_function("() => window.tributaryCharts.supersededCount() === 20", timeout=STAGE_MS)

        for page in pages:
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
            width = page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= page.viewport_size["width"], f"the run page scrolls sideways ({width} px wide)"
        # One run in the runs table, three attempts of it.
        runs = d.api("GET", f"/projects/{site.project}/runs")
        assert [r["id"] for r in runs["items"]] == [run_id]
        assert [a["from_step"] for a in d.run(run_id)["attempts"]] == [None, 30, 20]
    finally:
        for context in contexts:
            context.close()
    for console in consoles:
        assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())


def test_a_header_read_landing_while_an_action_is_out_leaves_the_header_to_the_action(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    """A status change heard while the user clicks Resume. The page reads its header again after
    the change (run.js's refresh) while the Resume form's post is out; when that read lands first,
    it must not replace the header under the form: htmx would swap the form's answer into the
    detached header, report its out-of-band parts (the attempts list, the checkpoint count) as
    htmx:oobErrorNoTarget and never show it (a CI run of the resume test above met this race).
    Both answers are held here and let go in that order, so the race happens every time."""
    d = site.deployment
    run_id, context, page, console = a_run_page(site, browser, "raced")
    try:
        page.wait_for_selector("body[data-history-loaded]")
        ship_attempt(site, run_id, EngineLog(tmp_path / "events.jsonl", run_id), attempt(1, 10, (10,)))
        page.wait_for_selector("#run-header[data-status=cancelled] #resume-button", timeout=STAGE_MS)

        is_read = lambda url: urlsplit(url).path == f"/runs/{run_id}/header/"  # noqa: E731
        is_post = lambda url: urlsplit(url).path == f"/runs/{run_id}/resume/"  # noqa: E731
        reads: list[Any] = []
        posts: list[Any] = []
        page.route(is_read, lambda route: route.continue_() if reads else reads.append(route))
        page.route(is_post, lambda route: posts.append(route))
        # Resumed through the API: the page hears the run queued (its badge moves at once) and
        # reads its header, held here. (A read still out from the cancellation is not held: its
        # answer, the run cancelled, is dropped, as the next test shows, and the read made again is.)
        d.api("POST", f"/runs/{run_id}/resume", {})
        page.wait_for_selector("#run-status[data-status=queued]", timeout=STAGE_MS)
        wait_held(page, reads)
        # Its header not read yet, the page still offers Resume: the user clicks it (post held).
        page.click("#resume-button")
        wait_held(page, posts)
        with page.expect_response(lambda r: is_read(r.url), timeout=STAGE_MS) as read:
            reads[0].continue_()
        read.value.finished()  # the read's answer is in the page before the post's leaves
        # The post's answer taken in: its form's htmx:afterRequest or, had the form been detached
        # under it, the errors its out-of-band parts met (that request's events reach no listener).
        page.evaluate(
            """() => {
                 const answered = () => { window.resumeAnswered = true; };
                 document.addEventListener("htmx:afterRequest", (e) => {
                   if (e.detail.requestConfig.path.endsWith("/resume/")) answered(); });
                 document.addEventListener("htmx:oobErrorNoTarget", answered);
               }"""
        )
        posts[0].continue_()
        page.wait_for_function("() => window.resumeAnswered === true", timeout=STAGE_MS)

        # The post's answer (the run is queued: nothing to resume) lands in the live header, then
        # the header is read again: the run queued, its second attempt listed, Cancel offered.
        page.wait_for_selector("#run-header[data-status=queued] #cancel-button", timeout=STAGE_MS)
        page.wait_for_selector("#run-attempts[data-count='2']", timeout=STAGE_MS)
        assert len(reads) == 1 and len(posts) == 1
    finally:
        context.close()
    no_errors(console)


def test_a_header_read_a_status_change_overtook_does_not_put_the_old_status_back(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    """The page hears the run cancelled and reads its header; before that read's answer lands,
    it hears the run resumed (its badge moves to queued at once). The answer shows the run
    cancelled: swapped in, it would put the cancelled badge and the Resume button back over the
    queued run until the next read lands (a CI run of the test above waited 30 s for the queued
    badge behind such a read). It must be dropped and the header read again. The read is held
    here and answered with what the server said before the resume, so the race happens every time."""
    d = site.deployment
    run_id, context, page, console = a_run_page(site, browser, "overtaken")
    try:
        page.wait_for_selector("body[data-history-loaded]")
        # Every badge the page shows, in order (a swap replaces the badge's element).
        page.evaluate(
            """() => {
                 window.badges = [];
                 const note = () => {
                   const s = document.querySelector("#run-status")?.dataset.status;
                   if (s && s !== window.badges.at(-1)) window.badges.push(s);
                 };
                 note();
                 new MutationObserver(note).observe(document.body,
                   { subtree: true, childList: true, attributes: true, attributeFilter: ["data-status"] });
               }"""
        )
        reads: list[Any] = []
        page.route(lambda url: urlsplit(url).path == f"/runs/{run_id}/header/", lambda r: reads.append(r))
        ship_attempt(site, run_id, EngineLog(tmp_path / "events.jsonl", run_id), attempt(1, 10, (10,)))
        page.wait_for_selector("#run-status[data-status=cancelled]", timeout=STAGE_MS)
        wait_held(page, reads)
        # The first read held (heard at the run's start; the changes after it wait behind it),
        # answered as the server has the run now: cancelled, Resume offered.
        before = reads[0].fetch()
        assert 'data-status="cancelled"' in before.text()

        d.api("POST", f"/runs/{run_id}/resume", {})
        page.wait_for_selector("#run-status[data-status=queued]", timeout=STAGE_MS)
        page.evaluate("() => { window.badges = ['queued']; }")
        reads[0].fulfill(response=before)
        wait_held(page, reads, 2)  # the header read again, after the answer was dropped
        assert page.get_attribute("#run-status", "data-status") == "queued"
        assert not page.is_visible("#resume-button")
        reads[1].continue_()
        page.wait_for_selector("#run-header[data-status=queued] #cancel-button", timeout=STAGE_MS)
        page.wait_for_selector("#run-attempts[data-count='2']", timeout=STAGE_MS)
        assert page.evaluate("() => window.badges") == ["queued"]  # never the cancelled one again
    finally:
        context.close()
    no_errors(console)
