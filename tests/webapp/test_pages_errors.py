"""Error responses: pages inside the site's layout (topbar, navigation, a way back), the API in
JSON, and the favicon a browser asks for (webapp/pages/errors.py, webapp/urls.py).

Django's test runner runs with DEBUG=False, the default of the settings, so these are the pages
a user of a deployment sees. The 500 comes from a view this module adds to the URLconf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.http import HttpRequest, HttpResponse
from django.test import Client
from django.urls import path

from tests.webapp.test_security_headers import blocked_by_policy
from webapp import urls as site_urls
from webapp.runs.models import Run
from webapp.teams.models import Project


def _explode(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("a bug in a view")


# This module is the URLconf of the tests marked ``urls(__name__)``: the site's, plus two views
# that fail, under the site's error handlers.
urlpatterns = [
    path("explode/", _explode),
    path("api/explode/", _explode),
    *site_urls.urlpatterns,
]
handler400 = site_urls.handler400
handler403 = site_urls.handler403
handler404 = site_urls.handler404
handler500 = site_urls.handler500


def assert_in_layout(response: HttpResponse, status: int, heading: str) -> str:
    """The error page of ``status``: HTML in base.html's layout with its navigation, nothing the
    CSP blocks, and not Django's bare page."""
    assert response.status_code == status
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert (
        '<header class="topbar">' in html and '<nav aria-label="Main"><a href="/">Projects</a></nav>' in html
    )
    assert f'data-status="{status}"' in html
    assert f'<h1 id="error-title">{heading}</h1>' in html
    assert '<link rel="icon" href="/static/tributary/favicon.svg" type="image/svg+xml">' in html
    assert blocked_by_policy(html) == []
    assert "<h1>Not Found</h1>" not in html and "Traceback" not in html
    return html


# --- 404 ---------------------------------------------------------------------------------------


def test_an_unknown_address_is_a_404_in_the_layout(client: Client) -> None:
    html = assert_in_layout(client.get("/no/such/page/"), 404, "Page not found")
    assert "There is no page at this address" in html
    assert 'href="/login/">Sign in</a>' in html  # anonymous: the topbar offers the sign-in
    assert "Resolver404" not in html and "tried" not in html


def test_a_404_names_what_is_missing_and_who_is_signed_in(
    client_for: Callable[..., Client], outsider: Any, run: Run
) -> None:
    response = client_for(outsider).get(f"/runs/{run.pk}/")
    html = assert_in_layout(response, 404, "Page not found")
    assert f'<p id="error-detail">run {run.pk} not found</p>' in html  # as for an id that does not exist
    assert "dave-outsider" in html and 'href="/workers/"' in html


def test_the_detail_of_a_404_is_escaped(client: Client) -> None:
    html = assert_in_layout(client.get("/share/%3Cscript%3Ealert(1)%3C%2Fscript%3E/"), 404, "Page not found")
    assert "<script>alert(1)" not in html


# --- 403 ---------------------------------------------------------------------------------------


def test_a_viewer_on_the_launch_form_gets_a_403_in_the_layout(
    client_for: Callable[..., Client], viewer: Any, project: Project
) -> None:
    html = assert_in_layout(client_for(viewer).get(f"/projects/{project.pk}/new/"), 403, "Not allowed")
    assert "needs the member role" in html and "you are viewer" in html
    assert "carol-viewer" in html


def test_a_viewer_posting_a_run_action_gets_a_403_in_the_layout(
    client_for: Callable[..., Client], viewer: Any, run: Run
) -> None:
    response = client_for(viewer).post(f"/runs/{run.pk}/cancel/")
    html = assert_in_layout(response, 403, "Not allowed")
    assert "needs the member role" in html
    run.refresh_from_db()
    assert run.cancel_requested_at is None


# --- CSRF --------------------------------------------------------------------------------------


def test_a_form_without_its_csrf_token_gets_a_403_in_the_layout(
    client_for: Callable[..., Client], member: Any, run: Run
) -> None:
    client = client_for(member, enforce_csrf_checks=True)
    response = client.post(f"/runs/{run.pk}/cancel/")
    html = assert_in_layout(response, 403, "The form has expired")
    assert "reload the page and send it again" in html
    assert "CSRF token" not in html and "CSRF cookie" not in html  # Django's words for developers
    assert "bob-member" in html
    run.refresh_from_db()
    assert run.cancel_requested_at is None
    # The page hands out a fresh token, so going back and sending again works.
    assert "csrftoken" in response.cookies


def test_an_api_call_without_its_csrf_token_still_gets_the_api_json(
    client_for: Callable[..., Client], member: Any, run: Run
) -> None:
    response = client_for(member, enforce_csrf_checks=True).post(f"/api/runs/{run.pk}/cancel")
    assert response.status_code == 403 and response["Content-Type"].startswith("application/json")
    assert "CSRF" in response.json()["detail"]


# --- 400 and 500 -------------------------------------------------------------------------------


def test_a_request_for_another_host_is_a_400_in_the_layout(client: Client) -> None:
    html = assert_in_layout(client.get("/", HTTP_HOST="evil.example"), 400, "Bad request")
    assert "evil.example" not in html  # the page does not echo what the server refused


def test_text_the_database_cannot_store_is_a_400_in_the_layout_naming_the_parameter(
    client_for: Callable[..., Client], member: Any, django_assert_num_queries: Any
) -> None:
    """Refused by webapp.middleware before the session exists: the page renders without it."""
    client = client_for(member)
    with django_assert_num_queries(0):
        response = client.get("/?status=a%00b")
    html = assert_in_layout(response, 400, "Bad request")
    assert "status" in html.split('id="error-detail">')[1].split("</p>")[0]
    api = client.get("/api/runs?status=a%00b")
    assert api.status_code == 400 and "status" in api.json()["detail"]


def test_an_exhausted_connection_pool_is_a_503_in_the_layout(django_assert_num_queries: Any) -> None:
    """webapp.dbpool's answer to a page that could not get a connection: the layout, without
    touching the database it could not reach, and Retry-After."""
    from django.test import RequestFactory

    from webapp.dbpool import MESSAGE, busy_response

    with django_assert_num_queries(0):
        response = busy_response(RequestFactory().get("/projects/1/"), api=False)
    html = assert_in_layout(response, 503, "The server is busy")
    assert MESSAGE in html and int(response["Retry-After"]) > 0


@pytest.mark.urls(__name__)
def test_a_failing_view_is_a_500_in_the_layout_without_a_query(
    client_for: Callable[..., Client], member: Any, django_assert_num_queries: Any
) -> None:
    client = client_for(member, raise_request_exception=False)
    with django_assert_num_queries(0):  # the session, the user and the database stay untouched
        response = client.get("/explode/")
    html = assert_in_layout(response, 500, "Something went wrong on the server")
    assert "the error is in its log" in html and "a bug in a view" not in html


@pytest.mark.urls(__name__)
def test_a_500_under_the_api_is_json(client: Client) -> None:
    response = Client(raise_request_exception=False).get("/api/explode/")
    assert response.status_code == 500 and response["Content-Type"].startswith("application/json")
    assert response.json() == {"detail": "internal error: the server log has the details"}


# --- the API keeps its JSON --------------------------------------------------------------------


def test_an_unknown_api_route_is_a_json_404(client: Client) -> None:
    response = client.get("/api/no-such-route")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")
    assert response.json() == {"detail": "no API route /api/no-such-route"}


def test_api_errors_of_the_views_are_unchanged(
    client_for: Callable[..., Client], outsider: Any, viewer: Any, run: Run
) -> None:
    missing = client_for(outsider).get(f"/api/runs/{run.pk}")
    assert missing.status_code == 404 and missing["Content-Type"].startswith("application/json")
    assert "detail" in missing.json()
    refused = client_for(viewer).post(f"/api/runs/{run.pk}/cancel")
    assert refused.status_code == 403 and "member role" in refused.json()["detail"]
    anonymous = Client().get(f"/api/runs/{run.pk}")
    assert anonymous.status_code == 401 and "detail" in anonymous.json()


# --- the favicon -------------------------------------------------------------------------------


def test_the_favicon_is_served_and_favicon_ico_leads_to_it(client: Client) -> None:
    icon = client.get("/static/tributary/favicon.svg")
    assert icon.status_code == 200 and icon["Content-Type"].startswith("image/svg+xml")
    svg = b"".join(icon.streaming_content) if icon.streaming else icon.content
    assert svg.startswith(b"<svg ") and b"<script" not in svg
    legacy = client.get("/favicon.ico")
    assert legacy.status_code == 302 and legacy["Location"] == "/static/tributary/favicon.svg"


def test_every_page_names_the_icon(client_for: Callable[..., Client], member: Any) -> None:
    html = client_for(member).get("/").content.decode()
    assert '<link rel="icon" href="/static/tributary/favicon.svg" type="image/svg+xml">' in html
