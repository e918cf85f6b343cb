"""A request that finds the database connection pool exhausted gets a 503, not a 500.

With the pool (``webapp.config.database_pool_from_env``) a web process holds at most
``DATABASE_POOL_MAX`` connections. Under a load it cannot serve in time, a request waits
``DATABASE_POOL_TIMEOUT`` seconds for one, then psycopg_pool raises ``PoolTimeout`` (or
``TooManyRequests`` with a waiting-queue limit), which Django wraps in its own
``OperationalError``. That is the server being busy, not broken: the caller gets a 503 with
``Retry-After`` and a message that says so, and the operator one warning line, not a traceback.

Pages go through ``PoolExhaustedMiddleware``; the API's own exception handler
(``webapp.api.api``) asks ``pool_exhausted`` the same question, since ninja turns view errors into
responses before a middleware sees them.
"""

from __future__ import annotations

import logging

from django.http import HttpRequest, HttpResponse, JsonResponse

from webapp.pages.errors import API_PREFIX, page_without_request

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
MESSAGE = "the server is busy: no database connection became free in time; try again in a few seconds"


def pool_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is the pool running out."""
    try:
        from psycopg_pool import PoolTimeout, TooManyRequests
    except ImportError:  # SQLite-only installs: no pool, nothing to run out of
        return False
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (PoolTimeout, TooManyRequests)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def busy_response(request: HttpRequest, *, api: bool) -> HttpResponse:
    log.warning("database pool exhausted: 503 for %s %s", request.method, request.path)
    if api:
        response: HttpResponse = JsonResponse({"detail": MESSAGE}, status=503)
    else:
        response = page_without_request(request.path, "503.html", 503, MESSAGE)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


class PoolExhaustedMiddleware:
    """``process_exception``: a 503 for a view that could not get a database connection."""

    def __init__(self, get_response: object) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)  # type: ignore[operator]

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if pool_exhausted(exception):
            return busy_response(request, api=request.path_info.startswith(API_PREFIX))
        return None
