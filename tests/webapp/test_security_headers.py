"""Headers and cookies for TLS deployments, and the Content-Security-Policy the pages live under.

- Settings from the environment (``TRIBUTARY_HTTPS`` and its overrides, ``CSP_MODE``), read by a
  fresh interpreter as a deployment would start, bad values refused with a message.
- A real uvicorn with ``TRIBUTARY_HTTPS=1`` behind a (simulated) TLS proxy: HSTS, Secure session
  and CSRF cookies, the CSP; and one without it, plain http://127.0.0.1 as in embedded mode,
  where sign-in still works (cookies a browser would send back over http).
- Every page renders nothing the policy would block (no inline script, style or handler), so
  the CSP cannot break them (tests/e2e/test_browser.py drives them in Chromium with it on).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tests.e2e.harness import Deployment
from webapp.runs.models import Run, ShareLink

POLICY = {
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "frame-ancestors 'none'",
    "form-action 'self'",
    "base-uri 'self'",
}


def directives(header: str) -> set[str]:
    return {d.strip() for d in header.split(";") if d.strip()}


# --- settings from the environment ------------------------------------------------------


def settings_with(**env: str) -> dict[str, Any]:
    """The security settings a fresh process reads with ``env`` (beside an empty data dir)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SECURE_", "SESSION_", "CSRF_", "CSP_"))}
    base.pop("TRIBUTARY_HTTPS", None)
    code = (
        "import json\n"
        "from webapp import settings as s\n"
        "print(json.dumps({k: getattr(s, k, None) for k in ("
        "'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS', "
        "'SECURE_HSTS_PRELOAD', 'SECURE_SSL_REDIRECT', 'SECURE_PROXY_SSL_HEADER', 'CSP_MODE')}))\n"
        "print(json.dumps([bool(getattr(s, 'CONTENT_SECURITY_POLICY', None)), "
        "bool(getattr(s, 'CONTENT_SECURITY_POLICY_REPORT_ONLY', None)), 'csp.middleware.CSPMiddleware' in s.MIDDLEWARE]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    values, csp = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    return {**values, "csp": csp}


def test_without_https_nothing_demands_tls() -> None:
    s = settings_with()
    assert s["SESSION_COOKIE_SECURE"] is False and s["CSRF_COOKIE_SECURE"] is False
    assert s["SECURE_HSTS_SECONDS"] == 0 and s["SECURE_PROXY_SSL_HEADER"] is None
    assert s["SECURE_SSL_REDIRECT"] is False
    assert s["csp"] == [True, False, True]  # the CSP is on in every mode


def test_tributary_https_turns_on_the_secure_set_and_each_part_can_be_overridden() -> None:
    s = settings_with(TRIBUTARY_HTTPS="1")
    assert s["SESSION_COOKIE_SECURE"] is True and s["CSRF_COOKIE_SECURE"] is True
    assert s["SECURE_HSTS_SECONDS"] == 365 * 24 * 3600
    assert s["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert s["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is False and s["SECURE_SSL_REDIRECT"] is False

    s = settings_with(
        TRIBUTARY_HTTPS="true",
        SECURE_HSTS_SECONDS="300",
        SECURE_HSTS_INCLUDE_SUBDOMAINS="yes",
        SESSION_COOKIE_SECURE="0",
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Scheme",
        SECURE_SSL_REDIRECT="1",
        CSP_MODE="report-only",
    )
    assert s["SECURE_HSTS_SECONDS"] == 300 and s["SECURE_HSTS_INCLUDE_SUBDOMAINS"] is True
    assert s["SESSION_COOKIE_SECURE"] is False and s["CSRF_COOKIE_SECURE"] is True
    assert s["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_SCHEME", "https"]
    assert s["SECURE_SSL_REDIRECT"] is True
    assert s["csp"] == [False, True, True]
    assert (
        settings_with(TRIBUTARY_HTTPS="1", SECURE_PROXY_SSL_HEADER="off")["SECURE_PROXY_SSL_HEADER"] is None
    )
    assert settings_with(CSP_MODE="off")["csp"] == [False, False, False]
    # Blank overrides (docker compose's ``${VAR:-}``) leave the TRIBUTARY_HTTPS defaults alone.
    blank = settings_with(
        TRIBUTARY_HTTPS="1", SESSION_COOKIE_SECURE="", SECURE_PROXY_SSL_HEADER="", SECURE_HSTS_SECONDS=""
    )
    assert blank["SESSION_COOKIE_SECURE"] is True and blank["SECURE_HSTS_SECONDS"] == 365 * 24 * 3600
    assert blank["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TRIBUTARY_HTTPS": "maybe"}, "TRIBUTARY_HTTPS='maybe' is not a boolean"),
        ({"SECURE_HSTS_SECONDS": "a year"}, "SECURE_HSTS_SECONDS='a year' is not an integer"),
        ({"SECURE_PROXY_SSL_HEADER": "X-Proto: https"}, "is not a header name: use e.g. X-Forwarded-Proto"),
        ({"CSP_MODE": "strict"}, "CSP_MODE='strict' is not one of enforce, report-only, off"),
    ],
)
def test_bad_values_are_refused_with_the_variable_named(env: dict[str, str], message: str) -> None:
    assert message in settings_with(**env).get("error", "")


# --- a real server, with and without TLS in front -------------------------------------------


class _Stop(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # show the 302 itself


_OPENER = urllib.request.build_opener(_Stop())


class Session:
    """A client that keeps cookies by hand (a cookie jar would drop Secure cookies on http);
    ``https=True`` adds what a TLS-terminating proxy in front sends (X-Forwarded-Proto)."""

    def __init__(self, base: str, *, https: bool) -> None:
        self.base, self.https = base, https
        self.set_cookies: list[str] = []  # every Set-Cookie header, as sent
        self.cookies: dict[str, str] = {}

    def request(self, path: str, form: dict[str, str] | None = None) -> Any:
        headers = {"X-Forwarded-Proto": "https"} if self.https else {}
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        data = None
        if form is not None:
            data = urllib.parse.urlencode(form).encode()
            headers["Origin"] = ("https://" if self.https else "http://") + self.base.split("://", 1)[1]
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=headers)
        try:
            response = _OPENER.open(request, timeout=30)
        except urllib.error.HTTPError as exc:  # the 302 after signing in
            response = exc
        for raw in response.headers.get_all("Set-Cookie") or []:
            self.set_cookies.append(raw)
            name, _, value = raw.split(";")[0].partition("=")
            self.cookies[name] = value
        return response

    def csrf(self) -> str:
        return self.cookies["csrftoken"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Deployment]]:
    deployments = {
        "https": Deployment(tmp_path_factory.mktemp("tls"), TRIBUTARY_HTTPS="1", ALLOWED_HOSTS="127.0.0.1"),
        "http": Deployment(tmp_path_factory.mktemp("plain"), ALLOWED_HOSTS="127.0.0.1"),
    }
    try:
        for d in deployments.values():
            d.setup("user.set_password('pass phrase 42'); user.save()")
            d.start_web()
        yield deployments
    finally:
        for d in deployments.values():
            d.stop_all()


def sign_in(session: Session) -> Any:
    page = session.request("/login/")
    assert page.status == 200
    return session.request(
        "/login/",
        {"username": "e2e", "password": "pass phrase 42", "csrfmiddlewaretoken": session.csrf(), "next": "/"},
    )


def cookie(session: Session, name: str) -> str:
    return next(c for c in session.set_cookies if c.startswith(f"{name}="))


def test_behind_tls_responses_carry_hsts_csp_and_secure_cookies(servers: dict[str, Deployment]) -> None:
    session = Session(servers["https"].url, https=True)
    response = sign_in(session)
    assert response.status == 302 and response.headers["Location"] == "/", response.status
    assert response.headers["Strict-Transport-Security"] == "max-age=31536000"
    assert directives(response.headers["Content-Security-Policy"]) >= POLICY
    for name in ("csrftoken", "sessionid"):
        assert "; secure" in cookie(session, name).lower(), cookie(session, name)
    home = session.request("/")
    assert home.status == 200 and "Strict-Transport-Security" in home.headers
    assert directives(home.headers["Content-Security-Policy"]) >= POLICY


def test_embedded_mode_over_plain_http_still_signs_in(servers: dict[str, Deployment]) -> None:
    session = Session(servers["http"].url, https=False)
    response = sign_in(session)
    assert response.status == 302 and response.headers["Location"] == "/", response.status
    assert "Strict-Transport-Security" not in response.headers
    assert directives(response.headers["Content-Security-Policy"]) >= POLICY
    for name in ("csrftoken", "sessionid"):
        assert "; secure" not in cookie(session, name).lower()  # a browser sends them back over http
    home = session.request("/")
    assert home.status == 200 and b"Sign out" in home.read()
    # Asking for TLS headers over plain http changes nothing when TLS is off.
    assert (
        "Strict-Transport-Security" not in Session(servers["http"].url, https=True).request("/login/").headers
    )


# --- the pages hold nothing the policy blocks ---------------------------------------------------

_SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script>", re.S | re.I)
_INLINE_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)


def blocked_by_policy(html: str) -> list[str]:
    """What in ``html`` a browser would block under ``POLICY``."""
    problems = []
    for attrs, body in _SCRIPT.findall(html):
        kind = re.search(r'type="([^"]+)"', attrs)
        if kind and kind.group(1) == "application/json":
            continue  # a data block, never executed
        src = re.search(r'src="([^"]+)"', attrs)
        if not src:
            problems.append(f"inline script: {body[:80]!r}")
        elif not src.group(1).startswith("/"):
            problems.append(f"script from another origin: {src.group(1)}")
        elif body.strip():
            problems.append(f"script with a body: {body[:80]!r}")
    problems += [
        f"<style> element: {m[:80]!r}" for m in re.findall(r"<style\b.*?</style>", html, re.S | re.I)
    ]
    problems += [f"style attribute: {m!r}" for m in re.findall(r"<[^>]+\sstyle\s*=[^>]*>", html, re.I)]
    problems += [f"inline handler: {m!r}" for m in _INLINE_HANDLER.findall(html)]
    problems += [f"javascript: URL: {m!r}" for m in re.findall(r"javascript:", html, re.I)]
    for href in re.findall(r'<link[^>]+href="([^"]+)"', html):
        if not (href.startswith("/") or href == "data:,"):
            problems.append(f"link to another origin: {href}")
    return problems


@pytest.fixture
def page_paths(run: Run, member: Any, project: Any, team: Any) -> Callable[[], list[str]]:
    def paths() -> list[str]:
        link = ShareLink.create(run, member)
        return [
            "/",
            f"/teams/{team.pk}/",
            f"/projects/{project.pk}/",
            f"/projects/{project.pk}/new/",
            f"/runs/{run.pk}/",
            f"/runs/{run.pk}/rollouts/",
            f"/compare/?runs={run.pk}",
            "/workers/",
            f"/share/{link.token}/",
            f"/share/{link.token}/rollouts/",
        ]

    return paths


def test_no_page_holds_what_the_policy_blocks(
    client_for: Callable[..., Any], member: Any, page_paths
) -> None:
    client = client_for(member)
    anonymous = client_for(None)
    for path in ["/login/", "/admin/login/"]:
        response = anonymous.get(path)
        assert response.status_code == 200
        assert blocked_by_policy(response.content.decode()) == [], path
    for path in page_paths():
        response = client.get(path)
        assert response.status_code == 200, (path, response.status_code)
        assert directives(response["Content-Security-Policy"]) >= POLICY, path
        assert blocked_by_policy(response.content.decode()) == [], path


def test_the_check_finds_what_the_policy_blocks() -> None:
    """The page check above can fail: each kind of blocked markup is found."""
    assert blocked_by_policy('<script>alert(1)</script><script type="application/json">{}</script>') == [
        "inline script: 'alert(1)'"
    ]
    assert len(blocked_by_policy('<div style="color:red" onclick="x()"><a href="javascript:x()">')) == 3
    assert blocked_by_policy('<script src="https://cdn.example/x.js"></script>') == [
        "script from another origin: https://cdn.example/x.js"
    ]
    assert blocked_by_policy("<style>p{}</style>") == ["<style> element: '<style>p{}</style>'"]
    assert (
        blocked_by_policy(
            '<link rel="stylesheet" href="/static/app.css"><script src="/static/a.js"></script>'
        )
        == []
    )


def test_the_css_and_scripts_the_pages_load_do_not_inject_inline_styles() -> None:
    """htmx would add a <style> element, and copy style attributes when it settles a swap (both
    blocked by style-src 'self'), unless told not to (the browser test caught the second)."""
    base = (REPO_ROOT / "webapp" / "pages" / "templates" / "base.html").read_text()
    assert '"includeIndicatorStyles": false' in base
    assert '"attributesToSettle": ["class", "width", "height"]' in base  # no setAttribute("style")
    statics = Path(REPO_ROOT / "webapp" / "pages" / "static" / "tributary")
    for script in statics.glob("*.js"):
        text = script.read_text()
        assert "eval(" not in text and "new Function" not in text, script.name
        assert not re.search(
            r"setAttribute\(\s*['\"]style|<style|innerHTML\s*=\s*[`'\"][^`'\"]*style=", text
        ), script.name
