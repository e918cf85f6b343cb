"""A queued run's page says why it waits and where it stands, and follows its place live (issue 15):
in a real Chromium against the real web process and a real worker (one run at a time) training a
tiny model.

Three runs on queue 'cpu': the worker trains the first; the last one's page (1440 and 390 px) says
it is 2nd in the queue behind one run, and what the worker is running. When the run ahead of the
queue ends, the page says, with no reload, that it is next and what the worker runs now; when that
one ends too, the worker takes it and its page shows it starting and training. Runs end by being
cancelled, which makes each stage wait for a condition instead of for a run's length. Screenshots in
.cache/artifacts/screenshots; time limits only keep a broken build from hanging.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow

STAGE_MS = 120_000  # a worker under load takes its time to import torch and start an engine


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("queue-site")) as s:  # one worker, concurrency 1
        yield s


def alert_is(page: Any, pattern: str) -> None:
    page.wait_for_function(
        "(p) => new RegExp('^' + p + '$').test(document.getElementById('run-alert')?.textContent.trim() || '')",
        arg=pattern,
        timeout=STAGE_MS,
    )


def test_a_queued_runs_page_follows_its_place_in_the_queue(
    site: Site, browser: Any, tiny_model_dir: Path
) -> None:
    test = "queue"
    d = site.deployment
    worker = re.escape(f"worker e2e0@{socket.gethostname()}")

    def launch(name: str, steps: int) -> int:
        config = tiny_config(tiny_model_dir, steps, name=name)
        return d.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": name})["id"]

    first = launch("demo-dapo", 100_000)
    d.wait_status(first, "running")
    second, mine = launch("second", 100_000), launch("mine", 100_000)
    pages, contexts, consoles = [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{mine}/")
        page.wait_for_selector("#live-state[data-state=open]")
        page.evaluate("() => { window.notReloaded = true; }")
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
    try:
        for page in pages:
            alert_is(
                page,
                re.escape("Waiting for a worker: 2nd in queue 'cpu' (1 queued run ahead); ")
                + worker
                + re.escape(f" is running demo-dapo (#{first})."),
            )
        screenshot(pages[0], test, "2nd-1440")
        screenshot(pages[1], test, "2nd-390")

        d.api("POST", f"/runs/{first}/cancel")  # the run ahead ends: the worker takes the next
        d.wait_status(second, "running")
        for page in pages:
            alert_is(
                page,
                re.escape("Waiting for a worker: next in queue 'cpu'; ")
                + worker
                + re.escape(f" is running second (#{second})."),
            )
            assert page.get_attribute("#run-header", "data-status") == "queued"
        screenshot(pages[0], test, "next-1440")
        screenshot(pages[1], test, "next-390")

        d.api("POST", f"/runs/{second}/cancel")  # now it is its turn: it starts, then trains
        for page in pages:
            page.wait_for_selector("#run-header[data-status=running]", timeout=STAGE_MS)
            alert_is(page, r"training on cpu · step \d+ of 100000")
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
        screenshot(pages[0], test, "running-1440")
        d.api("POST", f"/runs/{mine}/cancel")
        d.wait_status(mine, "cancelled")
    finally:
        for context in contexts:
            context.close()
    for console in consoles:
        no_errors(console)
