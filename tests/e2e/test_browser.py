"""The pages in a real browser against the real server and a real worker.

Debian's Chromium driven by Playwright (tests/e2e/browser.py); a web process and a Celery
worker in embedded mode (tests/e2e/harness.py); tiny engine runs on a CPU. A member signs in
through the login form, launches a run from the new-run form (YAML view), watches its charts
gain points while it runs, opens the rollout browser and searches it, and cancels it; two runs
are compared with their config diff; a share link opens read-only in a fresh context; a viewer
cannot launch. Each page is saved as a screenshot in .cache/artifacts/screenshots (1280 px wide,
and the run page at 390 px). Time limits only keep a broken build from hanging.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.browser import (
    NARROW,
    Site,
    new_context,
    no_errors,
    point_count,
    running_site,
    screenshot,
    sign_in,
)
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow

RUN_WAIT_MS = 240_000  # a loaded 2-core machine: worker pickup, torch import, first step


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("browser-site")) as s:
        yield s


@pytest.fixture(scope="module")
def finished_runs(site: Site, tiny_model_dir: Path) -> list[int]:
    """Two short runs launched through the API that differ in one trainer setting, both finished."""
    d = site.deployment
    ids = []
    for name, lr in (("baseline", 1e-4), ("higher-lr", 3e-4)):
        config = tiny_config(tiny_model_dir, total_steps=4, name=name)
        config["optimizer"] = {"lr": lr}
        ids.append(d.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": name})["id"])
    for run_id in ids:
        d.wait_status(run_id, "succeeded")
    return ids


def test_sign_in_launch_watch_rollouts_cancel(site: Site, browser: Any, tiny_model_dir: Path) -> None:
    test = "launch"
    context, console = new_context(browser)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # hx-confirm of the cancel button

    sign_in(page, site, "e2e")
    page.goto(f"{site.url}/")
    screenshot(page, test, "home")
    page.goto(f"{site.url}/teams/{site.team}/")
    screenshot(page, test, "team")
    page.goto(f"{site.url}/projects/{site.project}/")
    screenshot(page, test, "project-empty")

    # The new-run form: the YAML view of the editor (an htmx swap), filled with a tiny config.
    page.click("#new-run")
    page.wait_for_url(re.compile(r"/projects/\d+/new/"))
    page.wait_for_selector("#config-editor[data-mode=form]")
    screenshot(page, test, "new-run-form")
    page.click("#mode-yaml")
    page.wait_for_selector("#config-editor[data-mode=yaml] #config-yaml")
    config = tiny_config(tiny_model_dir, total_steps=5000, name="from-the-form")
    page.fill("#config-yaml", yaml.safe_dump(config, sort_keys=False))
    page.fill("#f-tags", "browser, e2e")
    screenshot(page, test, "new-run-yaml")
    page.click("#review-submit")  # the review step: the diff against the preset, then the launch
    page.wait_for_selector("#review")
    page.click("#launch-submit")
    page.wait_for_url(re.compile(r"/runs/\d+/$"))
    run_id = int(re.search(r"/runs/(\d+)/", page.url).group(1))

    # The charts gain points while the run runs (history, then the socket).
    page.wait_for_selector("body[data-history-loaded]")
    page.wait_for_selector("#run-status[data-status=running]", timeout=RUN_WAIT_MS)
    # Predicates are arrow functions: Playwright evals a bare expression in the page, which the
    # pages' Content-Security-Policy (no 'unsafe-eval') refuses.
    page.wait_for_function(
        "() => Number(document.querySelector('#charts').dataset.points) > 0", timeout=RUN_WAIT_MS
    )
    first = point_count(page)
    page.wait_for_function(
        f"() => Number(document.querySelector('#charts').dataset.points) > {first}", timeout=RUN_WAIT_MS
    )
    assert page.get_attribute("#run-status", "data-status") == "running"
    assert point_count(page) > first
    assert page.locator("#charts .chart-panel[data-panel=reward] canvas").count() >= 1
    assert int(page.get_attribute("#charts .chart-panel[data-panel=reward]", "data-points")) > 0
    assert int(page.get_attribute("#run-step", "data-step")) > 0
    screenshot(page, test, "run-charts")

    # The workers page: the deployment's worker, what it has, and this run on it.
    workers = context.new_page()
    workers.goto(f"{site.url}/workers/")
    row = workers.locator("#workers tbody tr")
    assert row.count() == 1
    assert "cpu" in row.inner_text() and "torch" in row.locator(".worker-backends").inner_text()
    # The worker published its entry again when it took the run (jobs.tasks): it lists it.
    assert "from-the-form" in workers.inner_text("#workers .worker-runs")
    screenshot(workers, test, "workers")
    workers.close()

    # The rollout browser (loaded into #rollouts when its tab opens), then a search.
    page.click("#tab-rollouts")
    page.wait_for_selector("#rollouts #rollout-browser")
    page.wait_for_selector("#rollout-browser .rollout-group", timeout=RUN_WAIT_MS)
    screenshot(page, test, "run-rollouts")
    prompt = page.inner_text("#rollout-browser .rollout-group .prompt-text")
    words = re.findall(r"[A-Za-z]{4,}|\d+", prompt)
    assert words, prompt
    query = max(words, key=len)
    page.fill("#rollout-q", query)
    page.wait_for_selector(f"#rollout-summary:has-text('matching “{query}”')")
    groups = page.locator("#rollout-browser .rollout-group")
    assert groups.count() >= 1
    for i in range(groups.count()):
        assert query.lower() in groups.nth(i).inner_text().lower()
    screenshot(page, test, "run-rollouts-search")

    page.click("#tab-config")
    assert "from-the-form" in page.inner_text("#config-yaml")
    screenshot(page, test, "run-config")
    page.click("#tab-logs")
    screenshot(page, test, "run-logs")

    # Cancel from the run page: the worker stops the engine; the page hears it on the socket.
    page.click("#tab-charts")
    page.click("#cancel-button")
    page.wait_for_selector("#run-status[data-status=cancelled]", timeout=RUN_WAIT_MS)
    assert site.deployment.run(run_id)["status"] == "cancelled"
    assert page.locator("#cancel-form").is_hidden()
    screenshot(page, test, "run-cancelled")

    page.goto(f"{site.url}/projects/{site.project}/")
    row = page.locator(f"#run-row-{run_id}")
    assert row.get_attribute("data-status") == "cancelled" or "ancel" in row.inner_text()
    screenshot(page, test, "project-runs")
    context.close()
    no_errors(console)


def test_compare_two_runs_shows_the_config_diff(site: Site, browser: Any, finished_runs: list[int]) -> None:
    test = "compare"
    context, console = new_context(browser)
    page = context.new_page()
    sign_in(page, site, "e2e")
    page.goto(f"{site.url}/projects/{site.project}/")
    for run_id in finished_runs:
        page.check(f"#run-row-{run_id} input.run-select")
    assert page.inner_text("#selected-count").startswith("2")
    page.click("#compare-selected")
    page.wait_for_url(re.compile(r"/compare/\?runs="))
    assert sorted(int(x) for x in re.search(r"runs=([\d,]+)", page.url).group(1).split(",")) == sorted(
        finished_runs
    )

    page.wait_for_function("() => Number(document.querySelector('#charts').dataset.points) > 0")
    assert page.locator("#compare-runs tbody tr").count() == 2
    differing = page.locator("#config-diff tr.differs")
    keys = [differing.nth(i).get_attribute("data-key") for i in range(differing.count())]
    assert "optimizer.lr" in keys, keys
    lr_row = page.locator("#config-diff tr[data-key='optimizer.lr']")
    assert lr_row.is_visible()
    assert "0.0001" in lr_row.inner_text() or "1e-4" in lr_row.inner_text().lower()
    assert page.locator("#config-diff tr.same").first.is_hidden()  # "only differences" is on
    screenshot(page, test, "compare")
    page.uncheck("#only-diff")
    assert page.locator("#config-diff tr.same").first.is_visible()
    screenshot(page, test, "compare-all-keys")
    context.close()
    no_errors(console)


def test_a_share_link_is_read_only_in_a_fresh_context(
    site: Site, browser: Any, finished_runs: list[int]
) -> None:
    test = "share"
    run_id = finished_runs[0]
    context, console = new_context(browser)
    page = context.new_page()
    sign_in(page, site, "e2e")
    page.goto(f"{site.url}/runs/{run_id}/")
    page.click("#share-create")
    link = page.locator("#share-list a.share-url").first
    link.wait_for()
    path = link.get_attribute("data-path")
    assert path and path.startswith("/share/"), path
    screenshot(page, test, "run-with-share")
    context.close()

    fresh, fresh_console = new_context(browser)  # no cookies: nobody signed in
    page = fresh.new_page()
    page.goto(f"{site.url}{path}")
    page.wait_for_selector("body[data-history-loaded]")
    page.wait_for_function("() => Number(document.querySelector('#charts').dataset.points) > 0")
    assert page.get_attribute("#run-page", "data-shared") == "true"
    for absent in ("#run-actions", "#cancel-button", "#resume-form", "#fork-link", "#share-create",
                   "#new-run", "#tab-logs", "a[href$='/new/']"):  # fmt: skip
        assert page.locator(absent).count() == 0, f"{absent} on the shared page"
    screenshot(page, test, "shared-run")
    page.click("#tab-rollouts")
    page.wait_for_selector("#rollouts #rollout-browser .rollout-group")
    screenshot(page, test, "shared-rollouts")
    # Nor through the server: the share context has no session to cancel or launch with.
    fresh_console.allowed.append(f"/api/runs/{run_id}/cancel")
    status = page.evaluate(
        "async (id) => (await fetch(`/api/runs/${id}/cancel`, {method: 'POST'})).status", run_id
    )
    assert status in (401, 403), status
    page.goto(f"{site.url}/projects/{site.project}/new/")
    assert "/login/" in page.url
    fresh.close()
    no_errors(console)
    no_errors(fresh_console)


def test_a_viewer_cannot_launch(site: Site, browser: Any, finished_runs: list[int]) -> None:
    test = "viewer"
    context, console = new_context(browser)
    page = context.new_page()
    sign_in(page, site, "viewer")
    page.goto(f"{site.url}/projects/{site.project}/")
    assert "viewer" in page.inner_text("#project-name")
    assert page.locator("#new-run").count() == 0
    assert page.locator("#cancel-selected").count() == 0
    screenshot(page, test, "project")
    console.allowed.append(f"/projects/{site.project}/new/")  # the 403 asked for next
    response = page.goto(f"{site.url}/projects/{site.project}/new/")
    assert response is not None and response.status == 403, response and response.status
    page.goto(f"{site.url}/runs/{finished_runs[1]}/")
    page.wait_for_selector("body[data-history-loaded]")
    assert page.locator("#cancel-button").count() == 0
    assert page.locator("#fork-link").count() == 0
    screenshot(page, test, "run")
    context.close()

    narrow, narrow_console = new_context(browser, NARROW)
    page = narrow.new_page()
    sign_in(page, site, "viewer")
    page.goto(f"{site.url}/runs/{finished_runs[1]}/")
    page.wait_for_function("() => Number(document.querySelector('#charts').dataset.points) > 0")
    width = page.evaluate("document.documentElement.scrollWidth")
    screenshot(page, test, "run-390px")
    narrow.close()
    assert width <= NARROW["width"], f"the run page scrolls sideways at 390 px ({width} px wide)"
    no_errors(console)
    no_errors(narrow_console)
