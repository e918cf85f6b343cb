"""The settings page in a real browser against the real server: a user signs in through the
login form, follows the top bar to the settings page, makes a personal API token, reads the
secret the page shows this once, checks that the secret works against the API and that a reload
no longer shows it, then revokes the token and sees the API refuse it. The page fits both widths
(no sideways scrolling) and nothing is logged to the console. Screenshots at 1440 and 390 px are
kept in .cache/artifacts/screenshots. No worker: nothing here runs a run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    new_context,
    no_errors,
    running_site,
    screenshot,
    sign_in,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("browser-settings"), worker=False) as s:
        yield s


def api_me_status(page: Any, secret: str) -> int:
    """The status of ``GET /api/me`` sent by the page's browser with the token and no cookie."""
    return page.evaluate(
        """async (secret) => (await fetch('/api/me', {
             credentials: 'omit', headers: {Authorization: `Bearer ${secret}`}})).status""",
        secret,
    )


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_a_token_is_made_shown_once_and_revoked(site: Site, browser: Any, viewport: dict[str, int]) -> None:
    test, size = "settings", f"{viewport['width']}px"
    context, console = new_context(browser, viewport)
    page = context.new_page()
    sign_in(page, site, "viewer")

    page.click(".topbar .user a[href='/settings/']")
    page.wait_for_url(f"{site.url}/settings/")
    name = f"script at {size}"
    page.fill("#id_name", name)
    page.click("#token-create")
    page.wait_for_url(f"{site.url}/settings/")
    secret = page.input_value("#new-token-secret")
    assert secret.startswith("trb_") and len(secret) > 30
    row = page.locator("#token-table tr", has_text=name)
    assert row.get_attribute("data-state") == "active"
    assert row.locator(".token-last-used").inner_text().strip() == "never"
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= viewport["width"], f"the settings page scrolls sideways ({width} px wide)"
    screenshot(page, test, f"created-{size}")

    assert api_me_status(page, secret) == 200
    page.reload()
    assert page.locator("#new-token-secret").count() == 0  # shown once
    assert secret not in page.content()
    assert row.locator(".token-last-used time").count() == 1  # the call above is listed

    row.locator("button", has_text="Revoke").click()
    page.wait_for_url(f"{site.url}/settings/")
    assert row.get_attribute("data-state") == "revoked"
    assert "Revoked the token" in page.inner_text(".messages")
    console.allowed.append("401")  # Chromium logs the refused call below
    assert api_me_status(page, secret) == 401
    screenshot(page, test, f"revoked-{size}")
    context.close()
    no_errors(console)
