""" "Import a verl run" in a real browser against the real server: from the project page, upload
verl's own files (``fixtures/verl/``: its metrics file and its rollout files, chosen together),
land on the run's page with the run finished and its charts drawn, at 1440 and 390 px, with
nothing logged to the console. Screenshots are kept in .cache/artifacts/screenshots."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.client.test_verl_follow import METRICS, ROLLOUTS
from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    new_context,
    no_errors,
    point_count,
    running_site,
    screenshot,
    sign_in,
)
from tests.e2e.conftest import browser  # noqa: F401 - the fixture
from tests.e2e.harness import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("browser-verl-import"), worker=False) as s:
        yield s


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_a_verl_run_is_imported_from_the_project_page(
    site: Site,
    browser: Any,  # noqa: F811
    viewport: dict[str, int],
) -> None:
    size = f"{viewport['width']}px"
    context, console = new_context(browser, viewport)
    page = context.new_page()
    sign_in(page, site, "e2e")
    page.goto(f"{site.url}/projects/{site.project}/")
    page.click("#import-verl")
    page.wait_for_selector("#verl-import-form")
    screenshot(page, "verl-import", f"form-{size}")
    page.fill("#id_name", f"verl {size}")
    page.set_input_files("#id_metrics", str(METRICS))
    page.set_input_files("#id_rollouts", [str(p) for p in sorted(ROLLOUTS.glob("*.jsonl"))])
    page.click("#verl-import")
    page.wait_for_url(lambda url: "/runs/" in url)
    run_id = int(page.url.rstrip("/").rsplit("/", 1)[-1])
    run = site.deployment.run(run_id)
    assert (run["status"], run["name"]) == ("succeeded", f"verl {size}")
    page.wait_for_selector("body[data-history-loaded]")
    wait_until(lambda: point_count(page) > 0, "the charts to draw verl's metrics", timeout=60)
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(page, "verl-import", f"run-{size}")
    no_errors(console)
    context.close()
