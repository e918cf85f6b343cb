"""Error responses: pages inside the site's layout, the API in its own JSON shape.

``webapp.urls`` names these as Django's ``handler400/403/404/500`` and settings name
``csrf_failure`` as ``CSRF_FAILURE_VIEW``. A page gets the topbar and a way back (the
templates beside ``base.html``: ``400.html``, ``403.html``, ``404.html``, ``403_csrf.html``,
``500.html``), never Django's bare "Not Found". Anything under ``/api/`` gets
``{"detail": "..."}`` as the API's own errors do (``webapp.api.api``): a script that asks for an
unknown route, or trips a middleware, reads JSON too.

The 500 page renders with no request context: whatever failed (the database, a context
processor, the session) must not fail the error page too, so it makes no query and reads no
session. The others render with the request, so the topbar shows who is signed in.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template import loader

API_PREFIX = "/api/"  # what is under it answers JSON, never a page

# What the page says when the exception carries no message of its own.
NOT_FOUND = "There is no page at this address, or it belongs to a team you are not in."
FORBIDDEN = "Your role in this team does not allow this."
BAD_REQUEST = "The server could not understand this request."
CSRF_FAILED = (
    "The form was sent without a valid security token: the page may have been open for too long, "
    "or you signed in or out in another tab. Go back, reload the page and send it again."
)
SERVER_ERROR = "internal error: the server log has the details"
SERVER_ERROR_PAGE = "The server could not complete this request; the error is in its log."


def _is_api(request: HttpRequest) -> bool:
    return request.path_info.startswith(API_PREFIX)


def _message(exception: BaseException | None, default: str) -> str:
    """The exception's own message when it has one (the views write theirs for people: "run not
    found", "this share link does not exist or was revoked"), else ``default``. A URL that matches
    no route raises ``Resolver404`` with a dict of the patterns tried, which is not for the page."""
    if exception is None or not exception.args or not isinstance(exception.args[0], str):
        return default
    return exception.args[0] or default


def _page(request: HttpRequest, template: str, status: int, context: dict[str, Any]) -> HttpResponse:
    return render(request, template, {"request_path": request.path, **context}, status=status)


def bad_request(request: HttpRequest, exception: BaseException | None = None) -> HttpResponse:
    # Django passes the SuspiciousOperation (a bad Host header, a malformed upload): its message
    # can name server settings, so the page keeps to the general words.
    if _is_api(request):
        return JsonResponse({"detail": "bad request"}, status=400)
    return _page(request, "400.html", 400, {"detail": BAD_REQUEST})


def permission_denied(request: HttpRequest, exception: BaseException | None = None) -> HttpResponse:
    detail = _message(exception, FORBIDDEN)
    if _is_api(request):
        return JsonResponse({"detail": detail}, status=403)
    return _page(request, "403.html", 403, {"detail": detail})


def page_not_found(request: HttpRequest, exception: BaseException | None = None) -> HttpResponse:
    if _is_api(request):
        return JsonResponse({"detail": _message(exception, f"no API route {request.path}")}, status=404)
    return _page(request, "404.html", 404, {"detail": _message(exception, NOT_FOUND)})


def page_without_request(path: str, template: str, status: int, detail: str) -> HttpResponse:
    """An error page in the layout rendered with no request, hence no context processors: no
    session, user or database read. For what fails before those exist or because they failed:
    the 500, the 503 of an exhausted connection pool (``webapp.dbpool``) and the 400 for input
    the database cannot store (``webapp.middleware``, which runs before the session)."""
    body = loader.get_template(template).render({"request_path": path, "detail": detail})
    return HttpResponse(body, status=status)


def server_error(request: HttpRequest) -> HttpResponse:
    if _is_api(request):
        return JsonResponse({"detail": SERVER_ERROR}, status=500)
    return page_without_request(request.path, "500.html", 500, SERVER_ERROR_PAGE)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """``CSRF_FAILURE_VIEW``. The API's session checks also come through here (django-ninja runs
    Django's CSRF middleware and answers its own 403 JSON), so they get a cheap JSON answer."""
    if _is_api(request):
        return JsonResponse({"detail": f"CSRF check failed: {reason}"}, status=403)
    # ``reason`` is Django's wording for a developer ("CSRF token missing."): kept out of the page.
    return _page(request, "403_csrf.html", 403, {"detail": CSRF_FAILED})
