"""The runs table's chosen columns in a real browser against the real server (issue 18).

Six finished runs of a sweep (rollout.n 4 or 8, their metrics stored through the ingest path).
The user adds a metric column and a config column from the pickers, sorts by the metric
(htmx: the rows reorder in place and the address follows), groups by the config key (one row per
value with the mean of the metric), opens a group to see its runs, and reloads: the view stays,
and the project's bare address brings it back (saved for the user). No console errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.e2e.browser import WIDE, Site, no_errors, running_site, screenshot, signed_in_page

pytestmark = pytest.mark.slow

SEED = """
import json, time
from django.contrib.auth import get_user_model
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
user = get_user_model().objects.get(username="e2e")
t0 = time.time() - 100
ids = []
for i in range(6):
    config = {{"name": f"sweep-{{i}}", "rollout": {{"n": 4 if i < 4 else 8}}, "algorithm": {{"clip_ratio_high": 0.28}}}}
    run = Run.objects.create(project_id={project}, created_by=user, name=f"sweep-{{i}}", config=config)
    events = [{{"type": "status", "state": "starting"}}, {{"type": "status", "state": "running"}}]
    for step in range(1, 4):
        values = {{"reward/mean": round(0.1 * i + 0.01 * step, 4), "actor/entropy": 1.0 / step}}
        events.append({{"type": "metrics", "step": step, "time": t0 + step, "values": values}})
    events.append({{"type": "status", "state": "succeeded", "message": "done"}})
    for seq, event in enumerate(events, 1):
        event.update(run=str(run.pk), seq=seq)
    store_events(run.pk, events)
    ids.append(run.pk)
print(json.dumps(ids))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("runs-columns-site"), worker=False) as s:
        yield s


def _names(page: Any) -> list[str]:
    return page.eval_on_selector_all("#runs-body tr .run-name a", "els => els.map(e => e.textContent.trim())")


def test_pick_columns_sort_group_and_reload(site: Site, browser: Any) -> None:
    out = site.deployment.manage("shell", "-c", SEED.format(project=site.project))
    assert len(json.loads(out.strip().splitlines()[-1])) == 6
    base = f"/projects/{site.project}/"
    context, page, console = signed_in_page(browser, site, "e2e", WIDE, base)

    # The pickers offer the project's metric names and config keys.
    options = page.eval_on_selector_all("#metric-names option", "els => els.map(e => e.value)")
    assert "reward/mean" in options
    assert "rollout.n" in page.eval_on_selector_all("#config-keys option", "els => els.map(e => e.value)")
    page.select_option("#add-metric-stat", "last")
    page.fill("#add-metric-key", "reward/mean")
    page.click("#add-metric-submit")
    page.wait_for_selector('th[data-spec="last:reward/mean"]')
    page.fill("#add-config-key", "rollout.n")
    page.click("#add-config-submit")
    page.wait_for_selector('th[data-spec="config:rollout.n"]')
    assert parse_qs(urlsplit(page.url).query)["col"] == ["last:reward/mean", "config:rollout.n"]

    # Sort by the metric, highest first (htmx swaps the results; the address follows).
    page.click('th[data-spec="last:reward/mean"] a.sort-col')
    page.wait_for_selector('th[data-spec="last:reward/mean"][aria-sort="descending"]')
    assert _names(page) == [f"sweep-{i}" for i in (5, 4, 3, 2, 1, 0)]
    page.wait_for_url(re.compile(r"sort=-last"))
    cells = page.eval_on_selector_all(
        "#runs-body tr td.chosen-col", "els => els.map(e => e.textContent.trim())"
    )
    assert cells[:2] == ["0.53", "8"]  # sweep-5: reward 0.5 + 0.03 at its last step, rollout.n 8
    screenshot(page, "runs-columns", "sorted")

    # Group by rollout.n: one row per value, the mean of the metric over its runs.
    page.fill("#add-group-key", "rollout.n")
    page.click("#add-group-submit")
    page.wait_for_selector("#groups-table")
    groups = page.eval_on_selector_all(
        "#groups-body tr",
        "rows => rows.map(r => [r.cells[0].textContent.trim(), r.querySelector('summary').textContent.trim(),"
        " r.cells[2].textContent.trim()])",
    )
    assert [(g[0], g[1]) for g in groups] == [("8", "2 runs"), ("4", "4 runs")]
    assert groups[0][2].startswith("0.48")  # mean of 0.43 and 0.53
    # Open the group of 4: its runs load into the row.
    page.click("#groups-body tr:nth-child(2) details summary")
    page.wait_for_selector("#groups-body tr:nth-child(2) .group-run-list li[data-run-id]")
    assert page.locator("#groups-body tr:nth-child(2) .group-run-list li[data-run-id]").count() == 4
    screenshot(page, "runs-columns", "grouped")

    # Reload keeps the view; the bare address brings back the saved one.
    page.reload()
    page.wait_for_selector("#groups-table")
    page.goto(f"{site.url}{base}")
    page.wait_for_selector("#groups-table")
    query = parse_qs(urlsplit(page.url).query)
    assert query["col"] == ["last:reward/mean", "config:rollout.n"] and query["group"] == ["rollout.n"]
    # Stop grouping: back to the runs, still with the chosen columns.
    page.click(".drop-group")
    page.wait_for_selector('#runs-table th[data-spec="config:rollout.n"]')
    assert len(_names(page)) == 6
    no_errors(console)
    context.close()
