"""Small things a user notices, in a real browser against the real server (issue 15).

A deployment without a worker: one run's events (metrics, one eval point, samples rewarded 0
and 1) are stored through the ingest path (``store_events``) from a ``manage.py shell``. Then
Chromium checks what the user sees: a log-scale y axis labelled with numbers (not "—"), a panel
with a single point that draws the point on an x range around it (not 0..100), rollout cards
coloured by reward, a launch form whose error summary counts the errors it lists, and a runs
table filtered without console errors. Screenshots at 1440 and 390 px in
.cache/artifacts/screenshots.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    no_errors,
    running_site,
    screenshot,
    signed_in_page,
)

pytestmark = pytest.mark.slow

EVAL_STEP = 10

# Stored through the ingest path, as a worker's events would be: steps 1..20 of a learning rate
# decaying from 1e-4 (a log axis over 1e-6..1e-4), a reward, train accuracy every step, one eval
# point at EVAL_STEP (eval/score alone in its panel; eval/accuracy among train/accuracy's steps),
# and one step of samples rewarded 0 and 1.
SEED = """
import json, time
from django.contrib.auth import get_user_model
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
user = get_user_model().objects.get(username="e2e")
run = Run.objects.create(project_id={project}, created_by=user, name="small-things", config={{"name": "small-things"}})
t0 = time.time() - 100
events = [{{"type": "status", "state": "starting"}}, {{"type": "status", "state": "running"}}]
for step in range(1, 21):
    values = {{"actor/lr": 1e-4 * 0.75 ** step, "reward/mean": step / 20, "train/accuracy": step / 25}}
    if step == {eval_step}:
        values.update({{"eval/score": 0.5, "eval/accuracy": 0.6}})
    events.append({{"type": "metrics", "step": step, "time": t0 + step, "values": values}})
items = [
    {{"prompt": "What is 2+2?", "completion": text, "reward": reward, "advantage": reward - 0.5,
      "length": 5, "finish_reason": "stop", "extra": {{"group": 0}}}}
    for text, reward in (("4", 1.0), ("5", 0.0), ("four", 1.0), ("22", 0.0))
]
events.append({{"type": "samples", "step": 20, "items": items}})
for seq, event in enumerate(events, 1):
    event.update(run=str(run.pk), seq=seq)
store_events(run.pk, events)
print(json.dumps({{"run": run.pk}}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("small-things-site"), worker=False) as s:
        yield s


@pytest.fixture(scope="module")
def run_id(site: Site) -> int:
    out = site.deployment.manage("shell", "-c", SEED.format(project=site.project, eval_step=EVAL_STEP))
    return json.loads(out.strip().splitlines()[-1])["run"]


def panel(panel_id: str) -> str:
    return f"#charts .chart-panel[data-panel='{panel_id}']"


# Pixels of the canvas of `selector` close to rgb: how much of a series' colour is drawn.
COUNT_COLOUR = """([selector, rgb]) => {
  const canvas = document.querySelector(selector + " canvas");
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let n = 0;
  for (let i = 0; i < data.length; i += 4) {
    if (Math.abs(data[i] - rgb[0]) + Math.abs(data[i + 1] - rgb[1]) + Math.abs(data[i + 2] - rgb[2]) < 60
        && data[i + 3] > 200) n++;
  }
  return n;
}"""
FIRST_COLOUR = (0x21, 0x60, 0xC4)  # charts.js PALETTE[0], a panel's first metric


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["wide", "narrow"])
def test_charts_log_ticks_and_one_point(site: Site, browser: Any, run_id: int, viewport: dict) -> None:
    test = f"small-things-charts-{viewport['width']}"
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")
    page.wait_for_selector("body[data-history-loaded]")
    page.wait_for_selector(f"{panel('group:eval')} canvas")
    page.wait_for_selector(f"{panel('lr')}[data-y-ticks]")

    # One point: a panel of its own, on a range around its step (uPlot alone spans 0..100), and
    # drawn as a dot (a line needs two points).
    eval_panel = panel("group:eval")
    page.locator(eval_panel).scroll_into_view_if_needed()
    low, high = map(float, page.get_attribute(eval_panel, "data-x-range").split(","))
    assert low < EVAL_STEP < high and high - low <= 4, (low, high)
    page.wait_for_function(f"() => ({COUNT_COLOUR})({json.dumps([eval_panel, FIRST_COLOUR])}) > 4")
    # The eval point among train/accuracy's 20 steps is drawn too (eval/accuracy comes first in
    # the legend, so it has the first colour; train/accuracy's line has the second).
    accuracy = panel("accuracy")
    assert page.get_attribute(accuracy, "data-series") == "2"
    page.locator(accuracy).scroll_into_view_if_needed()
    eval_dot = page.evaluate(COUNT_COLOUR, [accuracy, FIRST_COLOUR])
    assert eval_dot > 4, eval_dot
    screenshot(page, test, "one-point")

    # Log scale: the y axis of a learning rate from 1e-4 down to 3e-7 reads as numbers.
    lr = panel("lr")
    linear_ticks = page.get_attribute(lr, "data-y-ticks")
    page.check("#logscale")
    page.wait_for_function(
        f"() => document.querySelector({json.dumps(lr)}).dataset.yTicks !== {json.dumps(linear_ticks)}"
    )
    ticks = page.get_attribute(lr, "data-y-ticks").split()
    assert ticks and "—" not in ticks, ticks
    assert all(re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", t) for t in ticks), ticks
    assert "1e-4" in ticks or "1e-5" in ticks, ticks
    page.locator(lr).scroll_into_view_if_needed()
    screenshot(page, test, "log-scale")
    no_errors(console)
    context.close()


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["wide", "narrow"])
def test_rollout_cards_are_coloured_by_reward(site: Site, browser: Any, run_id: int, viewport: dict) -> None:
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")
    page.click("#tab-rollouts")
    page.locator("#rollouts").scroll_into_view_if_needed()  # it loads when it comes into view
    page.wait_for_selector("#rollout-browser .rollout-group")
    border = "el => getComputedStyle(el).borderLeftColor"
    zero = page.eval_on_selector("#rollout-browser .rollout[data-reward='0.0']", border)
    one = page.eval_on_selector("#rollout-browser .rollout[data-reward='1.0']", border)
    assert zero != one, (zero, one)
    red, green = (tuple(map(int, re.findall(r"\d+", c)[:3])) for c in (zero, one))
    assert red[0] > red[1] and green[1] > green[0], (red, green)
    # The number is there too, not only the colour.
    assert (
        page.inner_text("#rollout-browser .rollout[data-reward='0.0'] [data-stat=reward] strong") == "0.000"
    )
    assert "0.000" in page.inner_text("#reward-scale") and "1.000" in page.inner_text("#reward-scale")
    page.locator("#rollout-browser .rollout-group").first.scroll_into_view_if_needed()
    screenshot(page, f"small-things-rollouts-{viewport['width']}", "cards", full_page=False)
    no_errors(console)
    context.close()


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["wide", "narrow"])
def test_launch_error_summary_counts_its_errors(site: Site, browser: Any, viewport: dict) -> None:
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/projects/{site.project}/new/")
    page.wait_for_selector("#config-editor[data-mode=form]")
    page.fill("#f-rollout-n", "0")
    page.fill("#f-optimizer-lr", "-1")
    page.fill("#f-queue", "bad queue!")
    console.allowed.append("status of 422")  # the refused form comes back as 422
    page.click("#review-submit")
    page.wait_for_selector("#error-summary")
    shown = page.locator(".field-error").count() + page.locator("#error-summary li.general-error").count()
    listed = page.locator("#error-summary li").count()
    heading = page.inner_text("#error-summary h2")
    assert shown >= 3 and listed == shown, (shown, listed, heading)
    assert heading == f"Fix {shown} problems before launching", heading
    # Each line links to its field.
    for href in page.eval_on_selector_all(
        "#error-summary li a", "els => els.map((a) => a.getAttribute('href'))"
    ):
        assert page.locator(href).count() == 1, href
    screenshot(page, f"small-things-launch-{viewport['width']}", "errors", full_page=False)
    no_errors(console)
    context.close()


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["wide", "narrow"])
def test_runs_table_filter_has_no_console_errors(
    site: Site, browser: Any, run_id: int, viewport: dict
) -> None:
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/projects/{site.project}/")
    page.wait_for_selector(f"#run-row-{run_id}")
    # Typing (debounced input), a status box (change; leaving the search box once fired a
    # second request that aborted the first, which htmx logs as console errors), the Apply
    # button (submit), a sort link.
    page.fill("#filter-q", "no-such-run")
    page.wait_for_selector("#runs-results:not(:has(#runs-body tr))")
    page.fill("#filter-q", "small")
    page.wait_for_selector(f"#run-row-{run_id}")
    page.check("#filter-status-succeeded")
    page.wait_for_url(re.compile(r"status=succeeded"))
    page.wait_for_selector(f"#run-row-{run_id}", state="detached")
    page.uncheck("#filter-status-succeeded")
    page.wait_for_selector(f"#run-row-{run_id}")
    # Two boxes in quick succession: the second request waits for the first (none is aborted).
    page.check("#filter-status-failed")
    page.check("#filter-status-running")
    page.wait_for_url(lambda url: "status=failed" in url and "status=running" in url)
    page.wait_for_selector(f"#run-row-{run_id}")
    page.click("#filter-apply")
    page.wait_for_selector(f"#run-row-{run_id}")
    page.click("#sort-name")
    page.wait_for_url(re.compile(r"sort="))
    page.wait_for_selector(f"#run-row-{run_id}")
    page.wait_for_timeout(500)  # an htmx error is logged after the swap settles
    screenshot(page, f"small-things-runs-{viewport['width']}", "filtered")
    no_errors(console)
    context.close()
