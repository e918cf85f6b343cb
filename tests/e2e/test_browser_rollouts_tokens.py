"""Issue 18's rollouts down to the token, in a real Chromium against the real server: two real engine
runs on the tiny model (the same prompts, two temperatures) ship their events over the ingest socket
with the worker's own ``EventShipper``; the step view draws its reward histogram and scatter, a
completion's tokens are coloured by log-probability or entropy with the engine's values on hover and
from the keyboard, and a prompt's card opens both runs' completions side by side, all in the URL.
At 1440 and 390 px, with screenshots."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from engine.config import build_config
from engine.contracts import EXIT_SUCCEEDED
from engine.run import execute
from tests.e2e.browser import NARROW, WIDE, Site, no_errors, running_site, screenshot, signed_in_page
from tests.e2e.harness import WAIT
from tests.e2e.test_browser_analysis import new_run
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("tokens-site"), worker=False) as s:
        yield s


def engine_run(
    site: Site, model_dir: Path, out: Path, name: str, temperature: float
) -> tuple[int, list[dict]]:
    """A real two-step engine run whose events are shipped to a new run of the site: (run id, events)."""
    run_id = new_run(site, name)
    raw = tiny_config(model_dir, 2, name=name)
    raw["output_dir"] = str(out)
    raw["rollout"] = {"n": 4, "max_new_tokens": 12, "temperature": temperature}
    raw["logging"] = {
        "samples_per_step": 8,
        "token_samples_per_step": 8,
        "progress": "off",
        "heartbeat_s": 0.2,
    }
    events = out / "events.jsonl"
    assert execute(build_config(raw), events=str(events), run_id=str(run_id)) == EXIT_SUCCEEDED
    d = site.deployment
    token = d.manage(
        "shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))"
    )
    shipper = EventShipper(
        d.url, run_id, token.strip().splitlines()[-1], events, attach={"host": "tokens-box"},
        backoff_base=0.1, backoff_cap=1.0,
    ).start()  # fmt: skip
    try:
        assert shipper.finish(timeout=WAIT), d.logs()
    finally:
        shipper.stop()
    assert shipper.error is None
    return run_id, [json.loads(line) for line in events.read_text().splitlines() if line.strip()]


def test_histogram_token_view_and_side_by_side(
    site: Site, browser: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    test = "rollout-tokens"
    run_a, events_a = engine_run(site, tiny_model_dir, tmp_path / "a", "hot", 1.0)
    run_b, _ = engine_run(site, tiny_model_dir, tmp_path / "b", "cool", 0.7)
    last = [e for e in events_a if e["type"] == "samples"][-1]
    assert last["step"] == 2 and all("tokens" in item["extra"] for item in last["items"])

    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_a}/#rollouts")
        page.wait_for_selector("#rollout-browser[data-step='2']")

        # The histogram and the scatter are drawn: uPlot's canvases with something painted on them.
        for figure in ("#reward-histogram", "#length-reward-scatter"):
            page.wait_for_selector(f"{figure} canvas")
            painted = page.eval_on_selector(
                f"{figure} canvas",
                "c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                " let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }",
            )
            assert painted > 100, f"{figure} has nothing drawn"

        # The token view of the first completion: the engine's tokens, coloured, values on hover.
        card = page.locator("#rollouts article.rollout").first
        card.locator(".token-view summary").click()
        toks = card.locator(".token-view .tok")
        shown_texts = toks.evaluate_all("els => els.map((e) => e.textContent)")
        item = next(i for i in last["items"] if "".join(i["extra"]["tokens"]["text"]) == "".join(shown_texts))
        sent = item["extra"]["tokens"]
        assert shown_texts == sent["text"]
        titles = [toks.nth(i).get_attribute("title") for i in range(toks.count())]
        for title, lp, h in zip(titles, sent["logprob"], sent["entropy"]):
            assert title.startswith(f"logprob {lp:.3f}") and f"entropy {h:.3f}" in title
        # Coloured: an improbable token (any level under 4) has a background, by the legend's colours.
        levels = [int(toks.nth(i).get_attribute("data-lp-level")) for i in range(toks.count())]
        low = levels.index(min(levels))
        if levels[low] < 4:
            background = toks.nth(low).evaluate("el => getComputedStyle(el).backgroundColor")
            assert background not in ("rgba(0, 0, 0, 0)", "transparent")
        toks.nth(0).hover()
        readout = card.locator(".token-readout")
        assert f"logprob {sent['logprob'][0]:.3f}" in readout.inner_text()
        # From the keyboard: focus the tokens, move with the arrows, the readout (a live region) follows.
        card.locator(".tokens").focus()
        page.keyboard.press("End")
        assert f"logprob {sent['logprob'][-1]:.3f}" in readout.inner_text()
        page.keyboard.press("Home")
        page.keyboard.press("ArrowRight")
        active = card.locator(".tokens .tok.active")
        assert active.count() == 1
        assert active.evaluate("el => [...el.parentNode.children].indexOf(el)") == min(
            1, len(sent["text"]) - 1
        )
        # By entropy: the radio switches the colours and the view's URL keeps it.
        card.locator("input[value=entropy]").check()
        assert card.locator(".token-view").get_attribute("data-mode") == "entropy"
        assert card.locator(".token-legend[data-legend=entropy]").is_visible()
        page.wait_for_function(
            "() => new URL(location.href).searchParams.get('rollouts')?.includes('tokens=entropy')"
        )
        screenshot(page, test, f"tokens-{viewport['width']}px")

        # Side by side: from the prompt's card, choose the other run.
        prompt = page.inner_text("#rollouts .rollout-group .prompt-text")
        page.locator("#rollouts .rollout-group [data-compare]").first.click()
        page.wait_for_selector("#compare-with")
        # htmx binds the swapped form's hx-trigger in its settle phase, 20 ms after the swap (the
        # settling class comes off after that): a change before then would go unheard.
        page.wait_for_selector("#rollouts.htmx-settling", state="detached")
        page.select_option("#compare-with", str(run_b))
        page.wait_for_selector("#side-by-side .compare-side >> nth=1")
        sides = page.locator("#side-by-side .compare-side")
        assert [sides.nth(i).get_attribute("data-run") for i in range(2)] == [str(run_a), str(run_b)]
        assert sides.nth(1).locator("article.rollout").count() >= 1
        assert prompt.strip() in page.inner_text("#rollout-browser .followed-prompt")
        query = parse_qs(parse_qs(urlsplit(page.url).query)["rollouts"][0])
        assert query["with"] == [str(run_b)] and "compare" in query
        screenshot(page, test, f"side-by-side-{viewport['width']}px")
        page.reload()  # the URL reopens the comparison
        page.wait_for_selector("#side-by-side .compare-side >> nth=1")
        context.close()
        no_errors(console)
