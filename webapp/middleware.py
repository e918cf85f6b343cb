"""Refuse, with a 400 that names the parameter, request text the database cannot store.

Django decodes the URL path, the query string (``request.GET``) and form bodies
(``request.POST``, urlencoded or multipart) itself, before any view runs, and it decodes them
leniently: ``%00`` becomes a NUL character and bytes that are not UTF-8 become U+FFFD. A NUL
then reaches a query (a share token, a search text, a filter) and PostgreSQL raises, a 500.
Checking once here, where everything Django decoded is at hand, covers every page and API
route, present and future, instead of a guard in each view.

- URL path: a NUL (``/share/%00/``).
- Query string: percent-encoded bytes that are not UTF-8, and a NUL or lone surrogate in any
  parameter's name or value.
- Form bodies of the pages (urlencoded: the same UTF-8 check on the raw body; both kinds: the
  fields' names and values). The API reads JSON bodies, not forms; its schemas refuse such
  text with a 422 naming the field (``webapp.api.schemas``).

The API gets ``{"detail": "..."}`` (its error shape, documented as 400 on every operation);
pages get the same message as plain text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import unquote_to_bytes

from django.core.handlers.wsgi import get_bytes_from_wsgi
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.deprecation import MiddlewareMixin

from webapp.inputs import text_problem
from webapp.pages.errors import API_PREFIX, page_without_request

log = logging.getLogger(__name__)

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def _utf8_problem(raw: bytes, where: str) -> str | None:
    """Percent-decoded ``raw`` must be UTF-8 (Django would turn the rest into U+FFFD)."""
    try:
        unquote_to_bytes(raw.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"{where} is not valid UTF-8 (byte {exc.object[exc.start]:#04x}): percent-encode UTF-8 text"
    return None


def _fields_problem(fields: Iterable[tuple[str, list[str]]], kind: str) -> str | None:
    for name, values in fields:
        problem = text_problem(name)
        if problem:
            return f"{kind} name {name!r} {problem}"
        for value in values:
            problem = text_problem(value)
            if problem:
                return f"{kind} {name!r} {problem}"
    return None


def _raw_query(request: HttpRequest) -> bytes:
    scope = getattr(request, "scope", None)  # ASGIRequest: the bytes the server received
    if scope is not None:
        return scope.get("query_string", b"") or b""
    return get_bytes_from_wsgi(request.environ, "QUERY_STRING", "")


def input_problem(request: HttpRequest) -> str | None:
    """What in the request cannot be stored, named, or None."""
    problem = text_problem(request.path_info)
    if problem:
        return f"the URL path {problem}"
    problem = _utf8_problem(_raw_query(request), "the query string") or _fields_problem(
        request.GET.lists(), "query parameter"
    )
    if problem:
        return problem
    if request.path_info.startswith(API_PREFIX) or request.content_type not in FORM_TYPES:
        return None
    if request.content_type == FORM_TYPES[0]:
        problem = _utf8_problem(request.body, "the form body")
        if problem:
            return problem
    return _fields_problem(request.POST.lists(), "form field")


class RejectUnstorableInput(MiddlewareMixin):
    """A 400 for text that cannot be stored (see the module's docstring); everything else passes."""

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        problem = input_problem(request)
        if problem is None:
            return None
        if request.path_info.startswith(API_PREFIX):
            return JsonResponse({"detail": problem}, status=400)
        return page_without_request(request.path, "400.html", 400, problem)
