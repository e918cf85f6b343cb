"""The run page's Logs tab (issue 15) in a real Chromium against the real web process.

This test is the run's worker: it writes the engine's event log and its output file
(``engine.log``: what the engine's ranks print, with the engine's own log records mirrored in
it) and ships both with the worker's own ``EventShipper`` and ``OutputLog`` over the real
ingest socket. Halfway the shipper is stopped without a goodbye and a new one takes over from
the web app's cursors, as a restarted worker would. Two pages (1440 and 390 px) watch the lines
arrive live, filter them by level, search them, follow the newest until the reader scrolls up,
and download the full log, which must be the output file byte for byte. Screenshots go to
.cache/artifacts/screenshots; time limits only keep a broken build from hanging.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.log_bridge import mirror_lines
from tests.e2e.browser import NARROW, WIDE, Site, running_site, screenshot, signed_in_page
from tests.e2e.harness import WAIT, wait_until
from tests.tiny_runs import tiny_config
from tributary.shipper import EventShipper, OutputLog

pytestmark = pytest.mark.slow

STAGE_MS = 30_000


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("logs-site"), worker=False) as s:  # this test is the worker
        yield s


class Engine:
    """What an engine writes for ``run_id``: its event log and its output, appended as the test goes."""

    def __init__(self, root: Path, run_id: int) -> None:
        self.events = root / "events.jsonl"
        self.output = root / "engine.log"
        self.run = str(run_id)
        self.seq = 0
        self.events.write_text("")
        self.output.write_bytes(b"")

    def event(self, kind: str, **fields: Any) -> None:
        self.seq += 1
        with self.events.open("a") as fh:
            fh.write(json.dumps({"run": self.run, "seq": self.seq, "type": kind, **fields}) + "\n")

    def log(self, level: str, message: str) -> None:
        """A log record: an event, and its mirror in the output (as engine.log_bridge writes it)."""
        self.event("log", level=level, message=message)
        self.print(mirror_lines(time.time(), level, "engine", message).encode())

    def print(self, data: bytes) -> None:
        with self.output.open("ab") as fh:
            fh.write(data)


def ship(d: Any, run_id: int, token: str, engine: Engine) -> EventShipper:
    shipper = EventShipper(d.url, run_id, token, engine.events, backoff_base=0.1, backoff_cap=1.0)
    shipper.output = OutputLog(engine.output)  # the same file each time: a new worker goes on from the cursor
    return shipper.start()


def visible_messages(page: Any) -> list[str]:
    return page.eval_on_selector_all(
        "#logs li",
        "els => els.filter(li => li.offsetParent !== null).map(li => li.querySelector('.msg').textContent)",
    )


def wait_for_line(page: Any, text: str) -> None:
    page.wait_for_function(
        "t => [...document.querySelectorAll('#logs .msg')].some(m => m.textContent === t)",
        arg=text,
        timeout=STAGE_MS,
    )


def test_lines_arrive_live_filter_search_follow_and_download(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    test = "logs"
    d = site.deployment
    config = tiny_config(Path("unused"), total_steps=50, name="logged")
    run_id = d.api("POST", f"/projects/{site.project}/runs", {"config": config, "name": "logged"})["id"]
    token = d.manage(
        "shell", "-c", f"from webapp.runs.tokens import ingest_token; print(ingest_token({run_id}))"
    )
    token = token.strip().splitlines()[-1]

    pages, contexts, consoles = [], [], []
    for viewport in (WIDE, NARROW):
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/#logs")
        page.wait_for_selector("#live-state[data-state=open]")
        page.evaluate("() => { window.notReloaded = true; }")
        assert page.locator("#logs-empty").is_visible()
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
    wide, narrow = pages

    engine = Engine(tmp_path, run_id)
    shipper = ship(d, run_id, token, engine)
    try:
        # Live: the engine's records (events) and what its ranks print (output), with levels.
        engine.event("status", state="starting", message="loading model and data")
        engine.log("info", "loading the starter policy")
        engine.print(b"rank 1: NCCL ready\n\x1b[33mWARNING: slow tokenizer\x1b[0m\n")
        engine.log("warning", "transformers: some weights were not used")
        engine.event("status", state="running", message="training on cpu")
        engine.print(b"Traceback (most recent call last):\nValueError: a bad \xff byte\n")
        for page in pages:
            wait_for_line(page, "ValueError: a bad \ufffd byte")
            wait_for_line(page, "transformers: some weights were not used")
            messages = visible_messages(page)
            for line in ("loading the starter policy", "rank 1: NCCL ready", "WARNING: slow tokenizer"):
                assert line in messages
            assert not any("INFO engine:" in m for m in messages), "a mirrored record was shown twice"
            assert page.get_attribute("#logs li[data-kind=output] >> nth=1", "data-level") == "warning"
        screenshot(wide, test, "live-1440")
        screenshot(narrow, test, "live-390")

        # The worker stops mid-stream and a new one takes over from the web app's cursors.
        shipper.stop()
        engine.print(b"printed while no worker shipped\n")
        engine.log("error", "a reward worker died")
        shipper = ship(d, run_id, token, engine)
        for page in pages:
            wait_for_line(page, "printed while no worker shipped")
            wait_for_line(page, "a reward worker died")

        # Level filter and search, on the wide page.
        wide.select_option("#log-level", "warning")
        shown = visible_messages(wide)
        assert "rank 1: NCCL ready" not in shown and "loading the starter policy" not in shown
        assert "WARNING: slow tokenizer" in shown and "a reward worker died" in shown
        wide.fill("#log-search", "reward died")
        assert visible_messages(wide) == ["a reward worker died"]
        screenshot(wide, test, "filtered-1440")
        wide.fill("#log-search", "no such words")
        assert wide.locator("#logs-nomatch").is_visible()
        wide.fill("#log-search", "")
        wide.select_option("#log-level", "debug")

        # Follow: the newest line stays in view; scrolling up pauses it, the button resumes it.
        engine.print(b"".join(f"step {i} done\n".encode() for i in range(1, 301)))
        for page in pages:
            wait_for_line(page, "step 300 done")
            page.wait_for_function(
                "() => { const l = document.getElementById('logs'); return l.scrollTop + l.clientHeight >= l.scrollHeight - 24; }",
                timeout=STAGE_MS,
            )
        wide.eval_on_selector("#logs", "l => { l.scrollTop = 0; l.dispatchEvent(new Event('scroll')); }")
        wide.wait_for_selector("#log-newest:visible", timeout=STAGE_MS)
        assert not wide.is_checked("#log-follow")
        engine.print(b"a line while the reader reads older ones\n")
        wait_for_line(wide, "a line while the reader reads older ones")
        assert wide.eval_on_selector("#logs", "l => l.scrollTop") == 0, "follow scrolled although paused"
        screenshot(wide, test, "paused-1440")
        wide.click("#log-newest")
        assert wide.is_checked("#log-follow") and not wide.locator("#log-newest").is_visible()
        wide.wait_for_function(
            "() => { const l = document.getElementById('logs'); return l.scrollTop + l.clientHeight >= l.scrollHeight - 24; }",
            timeout=STAGE_MS,
        )

        engine.event("status", state="succeeded", message="finished 50 steps")
        engine.print(b"succeeded: events in events.jsonl\n")  # the CLI's last words, after the final status
        assert shipper.finish(timeout=WAIT), d.logs()
        assert shipper.output_acked == engine.output.stat().st_size
        for page in pages:
            page.wait_for_selector("#run-header[data-status=succeeded]", timeout=STAGE_MS)
            wait_for_line(page, "succeeded: events in events.jsonl")
            assert page.evaluate("() => window.notReloaded === true"), "the page was reloaded"
            offsets = page.eval_on_selector_all(
                "#logs li[data-kind=output]", "els => els.map(li => li.dataset.offset)"
            )
            assert len(offsets) == len(set(offsets)), "an output line was shown twice"
            events = page.eval_on_selector_all(
                "#logs li[data-kind=event]", "els => els.map(li => li.dataset.seq)"
            )
            assert len(events) == len(set(events)) == 3  # the three log events
        screenshot(wide, test, "finished-1440")
        screenshot(narrow, test, "finished-390")
        width = narrow.evaluate("() => document.documentElement.scrollWidth")
        assert width <= NARROW["width"], f"the Logs tab scrolls sideways at 390 px ({width} px wide)"

        # The full log downloads from the page: the output file, byte for byte.
        for page in pages:
            with page.expect_download(timeout=STAGE_MS) as info:
                page.click("#log-download")
            download = info.value
            assert download.suggested_filename == f"run-{run_id}-engine.log"
            saved = tmp_path / f"download-{page.viewport_size['width']}.log"
            download.save_as(saved)
            assert saved.read_bytes() == engine.output.read_bytes()

        # A finished run keeps its lines: a fresh page shows them without a socket.
        narrow.reload()
        narrow.wait_for_selector("body[data-history-loaded]")
        wait_for_line(narrow, "succeeded: events in events.jsonl")
        assert len(visible_messages(narrow)) == len(visible_messages(wide))
        # The server's lines show the time of day, as the live ones do (not a full date).
        clock = narrow.eval_on_selector("#logs li:last-child time", "t => t.textContent")
        assert clock == wide.eval_on_selector("#logs li:last-child time", "t => t.textContent"), clock
        screenshot(narrow, test, "reloaded-390")
    finally:
        shipper.stop()
        for context in contexts:
            context.close()
    assert shipper.error is None and shipper.acked_seq == engine.seq
    wait_until(lambda: d.run(run_id)["status"] == "succeeded", "the run to be stored as succeeded")
    for console in consoles:
        assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())


def test_a_real_runs_output_reaches_the_web_app_whole(deployment: Any, tiny_model_dir: Path) -> None:
    """The real worker and engine: everything the engine wrote to its ``engine.log`` reaches the
    web app byte for byte (the tail after its final status included), its lines are on the
    Logs tab, and the lines that mirror its log events are not there twice."""
    d = deployment()
    ids = d.setup()
    d.start_web()
    d.start_worker()
    config = tiny_config(tiny_model_dir, 3)
    run_id = d.api("POST", f"/projects/{ids['project']}/runs", {"config": config})["id"]
    assert d.wait_status(run_id, "succeeded", "failed")["status"] == "succeeded", d.logs()
    worker_log = d.data / "runs" / str(run_id) / "engine.log"
    stored_log = d.data / "run-logs" / f"{run_id}.log"

    def whole() -> bool:
        return stored_log.exists() and stored_log.read_bytes() == worker_log.read_bytes()

    wait_until(whole, "the engine's whole output at the web app")
    out = d.manage(
        "shell",
        "-c",
        "import json\nfrom webapp.runs.models import OutputLine\n"
        f"print(json.dumps(list(OutputLine.objects.filter(run_id={run_id}).values_list('message', flat=True))))",
    )
    output = json.loads(out.strip().splitlines()[-1])
    assert any(line.startswith("succeeded: events in ") for line in output), output  # the CLI's last line
    assert any(line.startswith("Loading weights: 100%") for line in output), (
        output
    )  # a progress bar's last state
    assert not any(" INFO engine: " in line or " WARNING engine: " in line for line in output), output
