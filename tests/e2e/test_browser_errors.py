"""Error pages and the favicon in a real browser against the real server (DEBUG off, as deployed).

A viewer signs in through the login form and meets a missing page (404), a page their role does
not allow (403) and a form whose CSRF cookie is gone (403): each renders inside the site's layout
with its navigation and who is signed in, fits the screen, and the expired form can be sent again
from the page it lands on. Every page names the site's SVG icon, which loads under the CSP, as
does ``/favicon.ico``; no request for an icon fails. Screenshots at 1440 and 390 px are kept in
.cache/artifacts/screenshots. No worker: nothing here runs a run.
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
    running_site,
    screenshot,
    sign_in,
)

pytestmark = pytest.mark.slow


# Loads a URL as an image, as the browser loads an icon (under the CSP's img-src): its width, or
# 0 when it did not load or is no image.
IMAGE_WIDTH = """async (url) => {
  const img = new Image();
  img.src = url;
  try { await img.decode(); } catch (e) { return 0; }
  return img.naturalWidth;
}"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("browser-errors"), worker=False, DEBUG="false") as s:
        yield s


def assert_error_page(page: Any, response: Any, status: int, heading: str, viewport: dict[str, int]) -> None:
    """The page ``response`` led to: ``status``, in the layout, signed in as the viewer, no
    sideways scrolling."""
    assert response is not None and response.status == status, response and response.status
    assert page.inner_text("#error-title") == heading
    assert page.locator(".topbar .brand").is_visible()
    assert page.locator(".topbar nav a[href='/']").inner_text() == "Projects"
    assert "viewer" in page.inner_text(".topbar .user")
    assert page.locator("#error-detail").inner_text().strip()
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= viewport["width"], f"the {status} page scrolls sideways ({width} px wide)"


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_error_pages_render_in_the_layout_and_every_icon_loads(
    site: Site, browser: Any, viewport: dict[str, int]
) -> None:
    test, size = "errors", f"{viewport['width']}px"
    context, console = new_context(browser, viewport)
    failed: list[str] = []  # every request that failed or was answered with an error
    # A request the browser itself abandoned (net::ERR_ABORTED: the icon a page fetches after its
    # load, when the test navigates on first) was answered with no error; the icon's loading is
    # checked below as images. Every other failure, and every error status, counts.
    context.on(
        "requestfailed", lambda r: r.failure != "net::ERR_ABORTED" and failed.append(f"{r.url}: {r.failure}")
    )
    context.on("response", lambda r: r.status >= 400 and failed.append(f"{r.url}: {r.status}"))
    page = context.new_page()
    sign_in(page, site, "viewer")

    # A page with the icon: the link names the SVG; it and /favicon.ico load as images.
    page.goto(f"{site.url}/")
    icon = page.get_attribute("link[rel=icon]", "href")
    assert icon == "/static/tributary/favicon.svg"
    assert page.evaluate(IMAGE_WIDTH, icon) > 0
    assert page.evaluate(IMAGE_WIDTH, "/favicon.ico") > 0
    screenshot(page, test, f"home-{size}")

    missing = f"{site.url}/no/such/page/"
    assert_error_page(page, page.goto(missing), 404, "Page not found", viewport)
    screenshot(page, test, f"404-{size}")

    forbidden = f"{site.url}/projects/{site.project}/new/"
    assert_error_page(page, page.goto(forbidden), 403, "Not allowed", viewport)
    assert "member role" in page.inner_text("#error-detail")
    screenshot(page, test, f"403-{size}")

    # A form sent without the CSRF cookie (as after the cookie expired): the layout says what to do,
    # and the page it lands on hands out a fresh token, so sending again from there works.
    page.goto(f"{site.url}/")
    context.clear_cookies(name="csrftoken")
    with page.expect_navigation() as sent:
        page.click(".topbar .user button[type=submit]")
    assert_error_page(page, sent.value, 403, "The form has expired", viewport)
    screenshot(page, test, f"403-csrf-{size}")
    page.click(".topbar .user button[type=submit]")
    page.wait_for_url(f"{site.url}/login/")
    context.close()

    provoked = (missing, forbidden, f"{site.url}/logout/")
    console.allowed.extend(provoked)  # Chromium logs each error status it was sent to
    assert not console.real(), "errors in the browser console:\n" + "\n".join(console.real())
    assert not console.favicon(), console.favicon()
    unexpected = [f for f in failed if not f.startswith(provoked)]
    assert not unexpected, "failed requests:\n" + "\n".join(unexpected)
