"""Continual training (issue 16) on the run page in a real Chromium against the real server: the stage
boundaries marked on every chart and the stage x eval-time accuracy heatmap, from points heard live and
from the stored history after a reload. Events travel with the worker's own ``EventShipper`` over the
real ingest socket (this test is the worker)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.e2e.test_browser_analysis import STAGE_MS, Engine
from tests.tiny_runs import tiny_config


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("stages-site"), worker=False) as s:
        yield s


HEATMAP = """() => [...document.querySelectorAll('#stage-heatmap tbody tr')].map((tr) =>
  [tr.dataset.stage, [...tr.querySelectorAll('td[data-value]')].map((td) => [Number(td.dataset.step), Number(td.dataset.value)])])"""

SAME = f"(expected) => JSON.stringify(({HEATMAP})()) === expected"

EXPECTED = [
    ["add", [[0, 0.25], [10, 0.75], [20, 0.5], [30, 0.5]]],
    ["count-down", [[20, 0.125], [30, 0.625]]],
]
EXPECTED_JSON = json.dumps(EXPECTED, separators=(",", ":"))


def test_stage_marks_and_the_accuracy_heatmap(site: Site, browser: Any, tmp_path: Path) -> None:
    config = tiny_config(Path("unused"), 30, name="staged")
    config["data"]["stages"] = [
        {"name": "add", "steps": 10},
        {"name": "count-down", "steps": 20, "task": "countdown"},
    ]
    run_id = site.deployment.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": "staged"})["id"]
    context, page, console = signed_in_page(browser, site, "e2e", WIDE, f"/runs/{run_id}/")
    page.wait_for_selector("body[data-history-loaded=true]")
    assert page.locator("#stage-heatmap").is_hidden()  # nothing evaluated yet
    engine = Engine(site, run_id, tmp_path / "events.jsonl")
    try:
        engine.write("status", state="running", message="training on cpu")
        engine.metrics(0, **{"eval/add/accuracy": 0.25, "eval/accuracy": 0.25})
        for step in range(1, 31):
            values = {"data/stage": 0.0 if step <= 10 else 1.0, "reward/mean": step / 30}
            if step in (10, 20, 30):
                add, cd = {10: (0.75, None), 20: (0.5, 0.125), 30: (0.5, 0.625)}[step]
                values["eval/add/accuracy"] = add
                if cd is not None:
                    values["eval/count-down/accuracy"] = cd
                    values["forgetting/add"] = 0.75 - add
            engine.metrics(step, **values)
        page.wait_for_function(SAME, arg=EXPECTED_JSON, timeout=STAGE_MS)
        # The boundary is marked on every chart panel (the marks are canvas: the grid lists them).
        page.wait_for_function("() => window.tributaryCharts.stageMarks().length > 0")
        marks = page.evaluate("() => window.tributaryCharts.stageMarks()")
        panels = page.evaluate("() => [...window.tributaryCharts.panels.entries()].filter(([, p]) => p.plot).map(([id]) => id)")
        assert sorted({m["panel"] for m in marks}) == sorted(panels) and len(panels) >= 2
        assert {(m["step"], m["name"]) for m in marks} == {(11, "count-down")}
        # The cells' colours follow the scale (stages.js colour: hue 120 x accuracy).
        cell = "document.querySelector(`#stage-heatmap tr[data-stage=count-down] td[data-step='${s}']`)"
        low, high = (page.evaluate(f"(s) => getComputedStyle({cell}).backgroundColor", s) for s in (20, 30))
        assert low.startswith("rgb") and high.startswith("rgb") and low != high
        screenshot(page, "stages", "run-1440px")
        # A reload builds the same heatmap from the stored history.
        page.reload()
        page.wait_for_selector("body[data-history-loaded=true]")
        page.wait_for_function(SAME, arg=EXPECTED_JSON, timeout=STAGE_MS)
        narrow_ctx, narrow, narrow_console = signed_in_page(browser, site, "e2e", NARROW, f"/runs/{run_id}/")
        narrow.wait_for_selector("#stage-heatmap tbody tr[data-stage=count-down]", timeout=STAGE_MS)
        screenshot(narrow, "stages", "run-390px")
        narrow_ctx.close()
    finally:
        engine.stop()
        context.close()
    no_errors(console)
    no_errors(narrow_console)
