"""Issue 18 in a real Chromium against the real server: health alerts raised live on an open run
page and its project's runs table, and the rollout search over every step whose view lives in
the page URL. Events travel with the worker's own ``EventShipper`` over the real ingest socket
(this test is the worker), at 1440 and 390 px, with screenshots."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.e2e.harness import WAIT
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper

STAGE_MS = 60_000


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("analysis-site"), worker=False) as s:
        yield s


class Engine:
    """Writes a run's event log the way the engine does and ships it with the worker's shipper."""

    def __init__(self, site: Site, run_id: int, path: Path) -> None:
        d = site.deployment
        token = d.manage("shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))")
        self.run_id, self.path, self.seq = run_id, path, 0
        path.write_text("")
        self.shipper = EventShipper(
            d.url, run_id, token.strip().splitlines()[-1], path, attach={"host": "analysis-box"},
            backoff_base=0.1, backoff_cap=1.0,
        ).start()  # fmt: skip

    def write(self, kind: str, **fields: Any) -> None:
        self.seq += 1
        with self.path.open("a") as fh:
            fh.write(json.dumps({"run": str(self.run_id), "seq": self.seq, "type": kind, **fields}) + "\n")

    def metrics(self, step: int, **values: float | None) -> None:
        self.write("metrics", step=step, time=1.7e9 + step, values=values)

    def stop(self) -> None:
        self.shipper.stop()
        assert self.shipper.error is None


def new_run(site: Site, name: str) -> int:
    config = tiny_config(Path("unused"), 30, name=name)
    return site.deployment.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": name})["id"]


def test_an_alert_reaches_the_open_run_page_and_runs_table_live(site: Site, browser: Any, tmp_path: Path) -> None:
    test = "alerts"
    run_id = new_run(site, "alerted")
    opened = []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")
        page.wait_for_selector("body[data-history-loaded=true]")
        assert page.inner_text("#alerts-count") == "0" and page.locator("#alerts-empty").is_visible()
        table_ctx, table, table_console = signed_in_page(browser, site, "e2e", viewport, f"/projects/{site.project}/")
        table.wait_for_selector(f"[data-run-id='{run_id}']")
        opened.append((viewport, context, page, console, table_ctx, table, table_console))

    engine = Engine(site, run_id, tmp_path / "events.jsonl")
    try:
        engine.write("status", state="starting", message="loading")
        engine.write("status", state="running", message="training on cpu")
        engine.metrics(1, **{"actor/pg_loss": 0.5, "actor/entropy": 0.4, "reward/mean": 0.1})
        engine.metrics(2, **{"actor/pg_loss": None, "actor/entropy": 0.4, "reward/mean": 0.2})
        engine.metrics(3, **{"actor/pg_loss": 0.4, "actor/entropy": 0.4, "reward/mean": 0.3})
        for viewport, _, page, _, _, table, _ in opened:
            page.wait_for_selector("#alerts li[data-rule=non_finite][data-step='2']", timeout=STAGE_MS)
            assert page.inner_text("#alerts-count") == "1" and not page.locator("#alerts-empty").is_visible()
            toast = page.locator(".toast")
            assert toast.count() == 1 and "Non-finite loss or gradient at step 2" in toast.inner_text()
            assert "actor/pg_loss is NaN or infinite" in toast.inner_text()
            # The chart of the metric marks the step.
            page.wait_for_function("() => (window.tributaryCharts?.alertMarks?.() || []).some((m) => m.step === 2)")
            table.wait_for_selector(f"[data-run-id='{run_id}'] [data-role=alert-count]", timeout=STAGE_MS)
            assert table.inner_text(f"[data-run-id='{run_id}'] [data-role=alert-count]").strip().startswith("1")
            screenshot(page, test, f"run-{viewport['width']}px")
            screenshot(table, test, f"table-{viewport['width']}px")
        # A reload lists it from the database, and toasts nothing.
        page = opened[0][2]
        page.reload()
        page.wait_for_selector("#alerts li[data-rule=non_finite]")
        assert page.inner_text("#alerts-count") == "1" and page.locator(".toast").count() == 0
    finally:
        engine.stop()
        for _, context, _, _, table_ctx, _, _ in opened:
            context.close()
            table_ctx.close()
    for *_, console, _, _, table_console in opened:
        no_errors(console)
        no_errors(table_console)


def test_a_search_finds_an_earlier_steps_completion_and_the_url_reopens_the_view(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "rollout-search"
    run_id = new_run(site, "searched")
    engine = Engine(site, run_id, tmp_path / "events.jsonl")
    try:
        engine.write("status", state="starting", message="loading")
        engine.write("status", state="running", message="training on cpu")
        for step in range(1, 26):
            text = "the zebra crossing\n" + "more\n" * 30 if step == 20 else f"plain {step}"
            item = {"prompt": f"prompt {step % 4}", "completion": text, "reward": step / 25, "advantage": 0.0,
                    "length": 5, "finish_reason": "stop", "extra": {}}  # fmt: skip
            engine.write("samples", step=step, items=[item])
        engine.write("status", state="succeeded", message="done")
        assert engine.shipper.finish(timeout=WAIT), site.deployment.logs()
    finally:
        engine.stop()

    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/#rollouts")
        page.wait_for_selector("#rollout-browser[data-step='25']")
        page.fill("#rollout-q", "ZEBRA")
        page.wait_for_selector("#rollout-browser[data-search=ZEBRA]")
        assert page.locator("[data-step-link]").all_inner_texts() == ["Step 20"]
        query = parse_qs(urlsplit(page.url).query)
        assert parse_qs(query["rollouts"][0])["q"] == ["ZEBRA"] and page.url.endswith("#rollouts")
        screenshot(page, test, f"every-step-{viewport['width']}px")
        page.reload()  # the URL reopens the search
        page.wait_for_selector("#rollout-browser[data-search=ZEBRA]")
        page.click("[data-step-link='20']")
        page.wait_for_selector("#rollout-browser[data-step='20']")
        assert page.input_value("#rollout-step") == str(19)  # the slider stands at step 20 (index 19)
        page.click("#rollouts details.completion-more summary")
        page.wait_for_function("() => new URL(location.href).searchParams.get('rollouts')?.includes('open=')")
        page.reload()  # the step, the search and the opened completion come back
        page.wait_for_selector("#rollout-browser[data-step='20'] details.completion-more[open]")
        assert "zebra crossing" in page.inner_text("#rollouts")
        screenshot(page, test, f"reopened-{viewport['width']}px")
        context.close()
        no_errors(console)
