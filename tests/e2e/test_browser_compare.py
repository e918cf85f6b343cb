"""The compare page in a real Chromium against the real server (issue 18, "Compare"): runs added
from the server-side search and dropped again without a reload (the link follows), one colour
per run on every panel and in the runs table, one panel per metric with a metric search that
adds panels, runs grouped by a config key drawn as their mean with a band, and the scatter and
parallel coordinates of the selected runs. The runs' metrics travel the real way: an engine event
log shipped by the worker's ``EventShipper`` over the ingest socket (this test is the worker).
The lines are canvas, so the assertions read the data attributes charts.js and
compare_analysis.js keep beside them (``data-colours``, ``data-groups``, ``data-points``...)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

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
from tests.e2e.test_browser_analysis import Engine
from tests.tiny_runs import tiny_config

STEPS = 12
# name -> (optimizer.lr, trainer.seed): two settings of two seeds each
RUNS = {"lr1-seed0": (1e-4, 0), "lr1-seed1": (1e-4, 1), "lr2-seed0": (2e-4, 0), "lr2-seed1": (2e-4, 1)}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("compare-site"), worker=False) as s:
        yield s


@pytest.fixture(scope="module")
def runs(site: Site, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """The four runs, finished, with reward/mean, actor/entropy and custom/score at every step."""
    ids: dict[str, int] = {}
    logs = tmp_path_factory.mktemp("compare-logs")
    for k, (name, (lr, seed)) in enumerate(RUNS.items()):
        config = tiny_config(Path("unused"), STEPS, name=name, seed=seed)
        config["optimizer"] = {"lr": lr}
        run_id = site.deployment.api(
            "POST", f"/projects/{site.project}/runs", {"config": config, "name": name}
        )["id"]
        engine = Engine(site, run_id, logs / f"{name}.jsonl")
        engine.write("status", state="starting", message="loading")
        engine.write("status", state="running", message="training on cpu")
        for step in range(1, STEPS + 1):
            engine.metrics(
                step,
                **{"reward/mean": lr * 1e3 * step + seed * 0.1, "actor/entropy": 1.0 - 0.01 * step - k * 0.02,
                   "custom/score": float(k)},
            )  # fmt: skip
        engine.write("status", state="succeeded", message="done")
        assert engine.shipper.finish(timeout=60), engine.shipper.error  # every event stored
        ids[name] = run_id
    return ids


def panels(page: Any) -> dict[str, dict[str, str]]:
    """Each metric panel's data attributes: metric -> {series, colours, groups, bands}."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('.chart-panel[data-metric]')].map((p) =>
             [p.dataset.metric, { series: p.dataset.series, colours: p.dataset.colours || '',
                                  groups: p.dataset.groups, bands: p.dataset.bands,
                                  legend: p.querySelectorAll('.u-legend .u-series').length - 1 }]))"""
    )


def colours(attr: str) -> dict[str, str]:
    return dict(part.rsplit(":", 1) for part in attr.split())


def settled(page: Any, n_runs: int) -> None:
    """The page has loaded every run's history and every panel draws ``n_runs`` lines."""
    page.wait_for_selector("body[data-history-loaded=true]")
    page.wait_for_function(
        """(n) => { const ps = [...document.querySelectorAll('.chart-panel[data-metric]')];
                    return ps.length >= 2 && ps.every((p) => p.querySelector('canvas')
                      && (p.dataset.colours || '').split(' ').filter(Boolean).length === n); }""",
        arg=n_runs,
    )


def run_ids_in_url(page: Any) -> list[int]:
    return [int(x) for x in re.search(r"runs=([\d,]*)", page.url).group(1).split(",") if x]


def test_add_drop_group_and_plot_runs_on_the_compare_page(
    site: Site, browser: Any, runs: dict[str, int]
) -> None:
    test = "compare-many"
    a, b, c, d = runs.values()
    context, page, console = signed_in_page(browser, site, "e2e", WIDE, f"/compare/?runs={a},{b}")
    settled(page, 2)
    shown = panels(page)
    # One panel per metric; the default RL metrics only (custom/score waits for the metric search).
    assert set(shown) == {"reward/mean", "actor/entropy"}, shown
    first = colours(shown["reward/mean"]["colours"])
    assert set(first) == {str(a), str(b)} and len(set(first.values())) == 2
    for p in shown.values():
        assert colours(p["colours"]) == first and p["legend"] == 2  # one legend entry per run
    table = {
        row.get_attribute("data-run-id"): row.get_attribute("data-colour")
        for row in page.locator("#compare-runs tbody tr").all()
    }
    assert table == first  # the runs table's swatches have the panels' colours

    # The search is the server's: the runs shown are not offered; a config value finds runs.
    page.fill("#compare-search", "optimizer.lr=2e-4")
    page.wait_for_function("() => document.querySelector('#compare-results').dataset.count === '2'")
    offered = sorted(
        int(x)
        for x in page.locator("#compare-results li").evaluate_all("(els) => els.map((e) => e.dataset.runId)")
    )
    assert offered == sorted([c, d])
    page.locator(f"#compare-results li[data-run-id='{c}'] button").click()
    page.wait_for_function(f"() => location.search.includes('runs={a},{b},{c}')")
    settled(page, 3)
    after_add = panels(page)
    for p in after_add.values():
        got = colours(p["colours"])
        assert {k: got[k] for k in first} == first and len(set(got.values())) == 3  # colours follow the runs
    assert page.locator("#compare-runs tbody tr").count() == 3
    screenshot(page, test, "three-runs")

    # Drop a run: it leaves every panel, the table and the link; the others keep their colours.
    page.locator(f"button.run-drop[data-run-id='{b}']").click()
    page.wait_for_function(
        f"() => location.search.includes('runs={a},{c}') && !location.search.includes(',{b}')"
    )
    settled(page, 2)
    assert all(str(b) not in colours(p["colours"]) for p in panels(page).values())
    assert colours(panels(page)["reward/mean"]["colours"])[str(a)] == first[str(a)]
    assert run_ids_in_url(page) == [a, c]

    # Back to all four, then group by the learning rate: one mean line per setting with its band.
    page.fill("#compare-search", "seed")
    page.wait_for_function(f"() => document.querySelector('#compare-results li[data-run-id=\"{b}\"]')")
    page.locator(f"#compare-results li[data-run-id='{b}'] button").click()
    page.wait_for_function(f"() => location.search.includes('runs={a},{c},{b}')")
    settled(page, 3)
    page.wait_for_function(f"() => document.querySelector('#compare-results li[data-run-id=\"{d}\"]')")
    page.locator(f"#compare-results li[data-run-id='{d}'] button").click()
    page.wait_for_function(f"() => location.search.includes('runs={a},{c},{b},{d}')")
    settled(page, 4)
    page.select_option("#group-key", "optimizer.lr")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.chart-panel[data-metric]')].every((p) => p.dataset.groups === '2')"
    )
    grouped = panels(page)
    # reward/mean differs between the seeds of a setting (seed * 0.1): both groups have a band.
    assert grouped["reward/mean"]["bands"] == "2" and grouped["reward/mean"]["legend"] == 2
    # A group has the colour of its first run, the same on every panel.
    group_colours = colours(grouped["reward/mean"]["colours"])
    assert group_colours == {
        "group0": first[str(a)],
        "group1": colours(after_add["reward/mean"]["colours"])[str(c)],
    }
    assert all(colours(p["colours"]) == group_colours for p in grouped.values())
    assert "group=optimizer.lr" in page.url
    page.select_option("#group-band", "std")
    page.wait_for_function("() => location.search.includes('band=std')")
    screenshot(page, test, "grouped")
    page.select_option("#group-key", "")
    settled(page, 4)

    # The metric search adds a panel of a metric no default panel shows.
    page.fill("#metric-search", "custom/score")
    page.dispatch_event("#metric-search", "change")
    page.wait_for_function(
        "() => { const p = document.querySelector('.chart-panel[data-metric=\"custom/score\"]');"
        " return p && p.querySelector('canvas') && p.dataset.series === '4'; }"
    )
    assert "custom/score" in parse_qs(urlsplit(page.url).query)["metrics"][0].split(",")  # the link keeps it

    # Scatter and parallel coordinates of the four runs, in their colours.
    page.fill("#analysis-metric", "reward/mean")
    page.dispatch_event("#analysis-metric", "change")
    page.select_option("#scatter-key", "optimizer.lr")
    page.wait_for_function("() => document.querySelector('#scatter').dataset.points === '4'")
    page.wait_for_function("() => document.querySelector('#parallel').dataset.lines === '4'")
    final = colours(panels(page)["reward/mean"]["colours"])
    assert colours(page.get_attribute("#scatter", "data-colours")) == final
    assert colours(page.get_attribute("#parallel", "data-colours")) == final
    axes = page.get_attribute("#parallel", "data-axes")
    assert "optimizer.lr" in axes and "trainer.seed" in axes and "reward/mean (final)" in axes
    assert page.locator("#scatter canvas").count() >= 1
    page.select_option("#analysis-agg", "max")  # the best value: from the summaries ingest keeps
    page.wait_for_function("() => location.search.includes('agg=max')")
    assert page.get_attribute("#scatter", "data-points") == "4"
    assert "reward/mean (max)" in page.get_attribute("#parallel", "data-axes")
    screenshot(page, test, "analysis")
    context.close()
    no_errors(console)


def test_the_compare_page_fits_a_phone(site: Site, browser: Any, runs: dict[str, int]) -> None:
    ids = ",".join(str(i) for i in runs.values())
    context, page, console = signed_in_page(
        browser, site, "e2e", NARROW, f"/compare/?runs={ids}&group=optimizer.lr"
    )
    page.wait_for_function(
        "() => [...document.querySelectorAll('.chart-panel[data-metric]')].some((p) => p.dataset.groups === '2')"
    )
    page.wait_for_function("() => document.querySelector('#parallel').dataset.lines === '4'")
    screenshot(page, "compare-many", "390")
    width = page.evaluate("() => document.documentElement.scrollWidth")
    context.close()
    assert width <= NARROW["width"], f"the compare page scrolls sideways at {NARROW['width']} px ({width} px)"
    no_errors(console)


# --- a live run, and adds in quick succession (review of issue 18) ------------------------------


def _stored(site: Site, engine: Engine) -> None:
    """Wait until the server stored every event the engine wrote (its cursor reached them)."""
    deadline = time.monotonic() + WAIT
    while site.deployment.run(engine.run_id)["last_seq"] < engine.seq:
        assert time.monotonic() < deadline, f"run {engine.run_id}: events not stored in {WAIT} s"
        assert engine.shipper.error is None, engine.shipper.error
        time.sleep(0.05)


def _steps(page: Any, run_id: int) -> dict[str, list[int]]:
    """The steps each series of run ``run_id`` holds in the charts, by metric."""
    return page.evaluate(
        """(id) => { const g = window.tributaryCharts;
             return Object.fromEntries([...g.store.series.values()].filter((s) => g.runs[s.run]?.id === id)
               .map((s) => [s.name, [...s.step]])); }""",
        run_id,
    )


def test_a_live_run_on_the_compare_page_misses_no_point(
    site: Site, browser: Any, runs: dict[str, int], tmp_path: Path
) -> None:
    """The page gets a live run's cursor with its data (read when the server rendered it), then
    reads its history, then follows its socket from that cursor. Points are stored here at the
    worst moment: after the server read the first panel's history and before the page has it
    (the answer is held), so only the socket can bring them, which it does only from a cursor
    read before that history (a cursor read after it would leave a gap). Every step must then
    be in every panel once, as stored."""
    finished = runs["lr1-seed0"]
    run_id = site.deployment.api(
        "POST", f"/projects/{site.project}/runs",
        {"config": tiny_config(Path("unused"), 30, name="live-compare"), "name": "live-compare"},
    )["id"]  # fmt: skip
    engine = Engine(site, run_id, tmp_path / "live.jsonl")
    names = ("reward/mean", "actor/entropy")

    def ship(steps: range) -> None:
        for step in steps:
            engine.metrics(step, **{name: 0.01 * step + k for k, name in enumerate(names)})

    try:
        engine.write("status", state="starting", message="loading")
        engine.write("status", state="running", message="training on cpu")
        ship(range(1, 6))
        _stored(site, engine)

        context, page, console = signed_in_page(browser, site, "e2e", WIDE, "/")
        # The run's series (api_base + /metrics/series): the page's first read of its history.
        is_history = lambda url: urlsplit(url).path == f"/api/runs/{run_id}/metrics/series"  # noqa: E731
        held: list[Any] = []

        def hold_the_first(route: Any) -> None:
            if held:
                route.continue_()  # the rest of the history goes through
            else:
                held.append(route)

        page.route(is_history, hold_the_first)
        with page.expect_request(lambda r: is_history(r.url), timeout=WAIT * 1000):
            page.goto(f"{site.url}/compare/?runs={finished},{run_id}")
        wait_held(page, held)
        answer = held[0].fetch()  # the history as the server reads it now: steps 1 to 5
        ship(range(6, 11))  # stored after that read, before the page has its answer
        _stored(site, engine)
        held[0].fulfill(response=answer)
        page.unroute(is_history)
        settled(page, 2)
        ship(range(11, 16))  # live, after the page loaded
        page.wait_for_function(
            """([id, names]) => { const g = window.tributaryCharts;
                 return names.every((n) => { const s = [...g.store.series.values()]
                   .find((s) => g.runs[s.run]?.id === id && s.name === n); return s && s.step.at(-1) === 15; }); }""",
            arg=[run_id, list(names)],
            timeout=WAIT * 1000,
        )
        got = _steps(page, run_id)
        stored = site.deployment.api("GET", f"/runs/{run_id}/metrics/series?x=step&names={','.join(names)}")[
            "series"
        ]
        assert {s["name"]: s["step"] for s in stored} == {name: list(range(1, 16)) for name in names}
        for name in names:
            assert got[name] == list(range(1, 16)), (name, got[name])  # as stored: none missing, none twice
        engine.write("status", state="succeeded", message="done")
        assert engine.shipper.finish(timeout=60), engine.shipper.error
        context.close()
        no_errors(console)
    finally:
        engine.shipper.stop()  # a failed test leaves no shipper retrying a stopped site


def test_two_quick_adds_both_land_with_their_own_colours(
    site: Site, browser: Any, runs: dict[str, int]
) -> None:
    """Run B added, then run C before B's parts came back: the page ends with both (it had
    asked for the page's old list plus C, so whichever answer came last won). B's answer is
    held here until C's Add was clicked, so the clicks always overlap."""
    a, b, c, _ = runs.values()
    context, page, console = signed_in_page(browser, site, "e2e", WIDE, f"/compare/?runs={a}")
    settled(page, 1)
    # The pick section is a form for a page without JavaScript; here Enter searches in place.
    page.evaluate("() => { window.samePage = true; }")
    page.fill("#compare-search", "lr")
    page.press("#compare-search", "Enter")
    page.wait_for_function(f"() => document.querySelector('#compare-results li[data-run-id=\"{c}\"]')")
    assert page.evaluate("() => window.samePage === true") and run_ids_in_url(page) == [a]
    held: list[Any] = []

    def hold_first(route: Any) -> None:
        if held:
            route.continue_()
        else:
            held.append(route)

    page.route("**/compare/parts/**", hold_first)
    with page.expect_request("**/compare/parts/**"):
        page.locator(f"#compare-results li[data-run-id='{b}'] button").click()
    page.locator(f"#compare-results li[data-run-id='{c}'] button").click()  # B still on its way
    wait_held(page, held)
    held[0].continue_()
    page.wait_for_function(f"() => location.search.includes('runs={a},{b},{c}')", timeout=WAIT * 1000)
    settled(page, 3)
    assert run_ids_in_url(page) == [a, b, c]
    shown = panels(page)
    for p in shown.values():
        got = colours(p["colours"])
        assert set(got) == {str(a), str(b), str(c)} and len(set(got.values())) == 3, got
    table = {
        row.get_attribute("data-run-id"): row.get_attribute("data-colour")
        for row in page.locator("#compare-runs tbody tr").all()
    }
    assert table == colours(shown["reward/mean"]["colours"])
    page.unroute("**/compare/parts/**")
    context.close()
    no_errors(console)
