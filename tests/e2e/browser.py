"""A real Chromium on the real server: Playwright driving Debian's ``chromium`` (never a browser
Playwright downloads), a deployment with a web process and a worker, users who sign in through
the login form, screenshots saved as test artifacts, and every console error and uncaught page
error collected so a test can show them.

Used by tests/e2e/test_browser.py and bench/ui.py.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT
from tests.e2e.harness import WAIT, Deployment

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The flags of /work/shared/MACHINE_NOTES.md: no GPU, no sandbox (root), and no traffic to
# Google's services (the resolver rule keeps Chromium from looking their names up).
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
]
SCREENSHOTS = REPO_ROOT / ".cache" / "artifacts" / "screenshots"
WIDE = {"width": 1440, "height": 900}  # the widths issue 15 asks screenshots at: 1440 and 390
NARROW = {"width": 390, "height": 844}
PASSWORD = "browser-e2e-password"  # a throwaway deployment's users


def launch_chromium(playwright: Any) -> Any:
    if not Path(CHROMIUM).exists():
        raise RuntimeError(
            "Debian's chromium is not installed: run `make browser` (apt-get install chromium)"
        )
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


@dataclass
class Site:
    """A deployment with a web process, a worker, a project, and two users of its team:
    ``e2e`` (admin) and ``viewer`` (viewer), both with ``PASSWORD``."""

    deployment: Deployment
    project: int
    team: int
    users: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.deployment.url


def start_site(root: Path, *, worker: bool = True, **settings: str) -> Site:
    """``prepare_site``, then the web process and (unless ``worker=False``) one worker."""
    site = prepare_site(root, **settings)
    site.deployment.start_web()
    if worker:
        site.deployment.start_worker()
    return site


@contextmanager
def running_site(root: Path, *, worker: bool = True, **settings: str) -> Iterator[Site]:
    """``start_site``, stopped afterwards with its processes' logs printed (pytest shows them
    when a test failed): the body of each browser test module's ``site`` fixture."""
    site = start_site(root, worker=worker, **settings)
    try:
        yield site
    finally:
        site.deployment.stop_all()
        print(site.deployment.logs())


def no_errors(console: Console) -> None:
    """Fail with the console's errors and uncaught page errors, if there were any."""
    assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())


def prepare_site(root: Path, **settings: str) -> Site:
    """Migrated database, users, team and project; no process started yet."""
    d = Deployment(root, **settings)
    ids = d.setup(
        "from webapp.teams.services import set_role\n"
        f"user.set_password({PASSWORD!r}); user.save()\n"
        f"viewer = get_user_model().objects.create_user('viewer', password={PASSWORD!r})\n"
        "set_role(team, viewer, 'viewer')\n"
        "out['team'] = team.pk\n"
    )
    team = ids["team"]
    return Site(d, ids["project"], team, {"e2e": PASSWORD, "viewer": PASSWORD})


@dataclass
class Console:
    """Console errors and uncaught exceptions of every page of a browser context."""

    errors: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)  # substrings of errors a test provoked itself

    def attach(self, context: Any) -> Console:
        context.on("console", self._console)
        context.on("weberror", lambda e: self.errors.append(f"uncaught: {e.error}"))
        return self

    def _console(self, message: Any) -> None:
        if message.type == "error":
            where = message.location.get("url", "") if message.location else ""
            self.errors.append(
                f"console.error at {message.page.url if message.page else '?'} ({where}): {message.text}"
            )

    def real(self) -> list[str]:
        """The errors that are not the missing favicon (reported separately)."""
        return [e for e in self.errors if "favicon" not in e and not any(a in e for a in self.allowed)]

    def favicon(self) -> list[str]:
        return [e for e in self.errors if "favicon" in e]


def new_context(browser: Any, viewport: dict[str, int] = WIDE) -> tuple[Any, Console]:
    context = browser.new_context(viewport=viewport, base_url=None)
    context.set_default_timeout(30_000)
    return context, Console().attach(context)


def signed_in_page(
    browser: Any, site: Site, username: str, viewport: dict[str, int], path: str = "/"
) -> tuple[Any, Any, Console]:
    """A new context at ``viewport``, signed in as ``username`` through the login form, showing
    ``path``: ``(context, page, console)``."""
    context, console = new_context(browser, viewport)
    page = context.new_page()
    sign_in(page, site, username)
    page.goto(f"{site.url}{path}")
    return context, page, console


def watched_run_pages(
    browser: Any, site: Site, run_id: int, viewports: tuple[dict[str, int], ...] = (WIDE, NARROW)
) -> tuple[list[Any], list[Any], list[Console]]:
    """The run's page open at each of ``viewports`` as ``e2e``, its history loaded and its socket
    live, each marked ``window.notReloaded`` (a reload would drop it): ``(pages, contexts, consoles)``."""
    pages, contexts, consoles = [], [], []
    for viewport in viewports:
        context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")
        page.wait_for_selector("body[data-history-loaded]")
        page.wait_for_selector("#live-state[data-state=open]")
        page.evaluate("() => { window.notReloaded = true; }")
        pages.append(page)
        contexts.append(context)
        consoles.append(console)
    return pages, contexts, consoles


def sign_in(page: Any, site: Site, username: str) -> None:
    """Through the real login form."""
    page.goto(f"{site.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", site.users[username])
    page.click("form[action='/login/'] button[type=submit]")
    page.wait_for_url(lambda url: "/login/" not in url)


def screenshot(page: Any, test: str, name: str, *, full_page: bool = True) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{test}-{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def point_count(page: Any) -> int:
    """Points the run page's charts hold (``#charts[data-points]``, kept by charts.js)."""
    return int(page.eval_on_selector("#charts", "el => Number(el.dataset.points || 0)"))


def wait_held(page: Any, held: list[Any], count: int = 1, timeout: float = WAIT) -> None:
    """Until a route of ``page`` has held ``count`` requests (appended to ``held``). A route's
    handler runs only while Playwright dispatches, beside the request event, so the wait is the
    page's own (``wait_for_timeout``), not a sleep; a request that never comes fails the test after
    ``timeout`` seconds instead of hanging the suite."""
    deadline = time.monotonic() + timeout
    while len(held) < count:
        assert time.monotonic() < deadline, f"{len(held)} of {count} requests held after {timeout:.0f} s"
        page.wait_for_timeout(20)


def tributary_playwright() -> Iterator[Any]:
    """A started sync Playwright (stopped when the generator closes)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        yield playwright


def text_of(page: Any, selector: str) -> str:
    """The element's visible text, trimmed."""
    return page.inner_text(selector).strip()


def wider_than_the_window(page: Any, limit: int = 5) -> list[str]:
    """The innermost elements reaching past the window's right edge (tag#id.class and right edge):
    what a failed no-sideways-scroll check names."""
    return page.evaluate(
        r"""(limit) => {
          const width = document.documentElement.clientWidth;
          const past = [...document.body.querySelectorAll('*')].filter(
            (el) => el.getBoundingClientRect().right > width + 1 && el.getClientRects().length);
          const innermost = past.filter((el) => !past.some((other) => other !== el && el.contains(other)));
          return innermost.slice(0, limit).map((el) =>
            `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}${el.className && typeof el.className === 'string'
              ? '.' + el.className.trim().split(/\s+/).join('.') : ''} right=${Math.round(el.getBoundingClientRect().right)}`);
        }""",
        limit,
    )
