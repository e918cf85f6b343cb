"""The ``NinjaAPI`` instance: routers, authentication and how errors become responses.

Errors keep one shape: ``{"detail": "..."}``, except 422, which is ninja's own
``{"detail": [{"type", "loc", "msg"}, ...]}`` for every bad field, whether the request's
shape or the engine's config schema refused it.

| status | when |
|---|---|
| 400 | text the database cannot store in the URL or query string (a NUL, bytes that are not UTF-8: ``webapp.middleware``), or a body that is not JSON |
| 401 | no session and no API token, or an unknown/revoked token |
| 403 | the caller sees the object but lacks the role (viewer < member < admin), or CSRF failed |
| 404 | no such object, or it belongs to a team the caller has no role in |
| 409 | the run's state forbids it (cancel a finished run, resume a running one, resume or fork an external run, an engine run's ingest token), or an archived project takes no new external run |
| 422 | a bad field (each named by ``loc``), among them text with a NUL or a lone surrogate and integers beyond the column's range (``webapp.api.schemas``) |
| 429 | too many failed API token checks from the caller's address (``Retry-After``) |
| 503 | no database connection became free in time (``Retry-After``; ``webapp.dbpool``) |

Each operation lists the ones it can answer in the OpenAPI document (``webapp.api.routers``);
``tests/webapp/test_schemathesis.py`` holds it to that.
"""

from __future__ import annotations

import logging
import re

from django.db import OperationalError
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, Throttled
from ninja.operation import Operation

from webapp.api.auth import API_AUTH
from webapp.api.routers import (
    account,
    alerts,
    data,
    engine,
    external,
    housekeeping,
    projects,
    runs,
    shares,
    workers,
)
from webapp.dbpool import busy_response, pool_exhausted
from webapp.runs.models import InvalidTransition
from webapp.runs.services import CannotResume, ProjectArchived, RunConfigInvalid
from webapp.teams.access import Forbidden, NotFound

log = logging.getLogger(__name__)


class TributaryAPI(NinjaAPI):
    def get_openapi_operation_id(self, operation: Operation) -> str:
        # The view's own name (unique across the routers): list_runs, launch_run, metric_series...
        return operation.view_func.__name__


api = TributaryAPI(
    title="Tributary API",
    version="1",
    description=(
        "Projects, runs, metrics and rollouts of the Tributary RL post-training platform.\n\n"
        "Authenticate with the browser session (unsafe methods need the CSRF token in "
        "`X-CSRFToken`) or a personal API token: `Authorization: Bearer <token>` "
        "(create one with `POST /api/tokens`). Anything of a team you have no role in is a 404."
    ),
    urls_namespace="api",
    auth=API_AUTH,
    # Swagger UI would come from a CDN (no static files are served yet): the document only.
    docs_url=None,
)

api.add_router("", account.router)
api.add_router("", engine.router)
api.add_router("", projects.router)
api.add_router("", external.router)  # before runs: /runs/external is no run id
api.add_router("", runs.router)
api.add_router("", housekeeping.router)
api.add_router("", data.router)
api.add_router("", shares.router)
api.add_router("", shares.public_router)
api.add_router("", workers.router)
api.add_router("", alerts.router)


def _detail(request: HttpRequest, message: str, status: int) -> HttpResponse:
    return api.create_response(request, {"detail": message}, status=status)


@api.exception_handler(NotFound)
def _not_found(request: HttpRequest, exc: NotFound) -> HttpResponse:
    return _detail(request, str(exc) or "not found", 404)


@api.exception_handler(Forbidden)
def _forbidden(request: HttpRequest, exc: Forbidden) -> HttpResponse:
    return _detail(request, str(exc) or "forbidden", 403)


@api.exception_handler(AuthenticationError)
def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    message = (
        exc.message
        if exc.message != "Unauthorized"
        else ("authentication required: log in, or send 'Authorization: Bearer <API token>'")
    )
    response = _detail(request, message, 401)
    response["WWW-Authenticate"] = 'Bearer realm="api"'
    return response


_INDEX = re.compile(r"\[(\d+)\]")


def config_loc(path: str) -> list[str | int]:
    """``config.reward.functions[1].weight`` (or ``functions.1``) -> [..., 'functions', 1, 'weight'].

    List positions become integers, as in pydantic's own ``loc``."""
    loc: list[str | int] = []
    for part in path.split("."):
        pieces = _INDEX.split(part)  # "functions[1]" -> ["functions", "1", ""]
        if pieces[0]:
            loc.append(int(pieces[0]) if pieces[0].isdigit() else pieces[0])
        loc.extend(int(i) for i in pieces[1::2])
    return loc


@api.exception_handler(RunConfigInvalid)
def _config_invalid(request: HttpRequest, exc: RunConfigInvalid) -> HttpResponse:
    detail = [
        {"type": "config_invalid", "loc": ["body", "payload", *config_loc(path)], "msg": msg}
        for path, msg in exc.problems
    ]
    return api.create_response(request, {"detail": detail}, status=422)


@api.exception_handler(InvalidTransition)
def _invalid_transition(request: HttpRequest, exc: InvalidTransition) -> HttpResponse:
    return _detail(request, str(exc), 409)


@api.exception_handler(CannotResume)
def _cannot_resume(request: HttpRequest, exc: CannotResume) -> HttpResponse:
    return _detail(request, str(exc), 409)


@api.exception_handler(ProjectArchived)
def _project_archived(request: HttpRequest, exc: ProjectArchived) -> HttpResponse:
    return _detail(request, str(exc), 409)


@api.exception_handler(Throttled)
def _throttled(request: HttpRequest, exc: Throttled) -> HttpResponse:
    response = _detail(request, str(exc), 429)
    if exc.wait:
        response["Retry-After"] = str(int(exc.wait))
    return response


@api.exception_handler(OperationalError)
def _database_unavailable(request: HttpRequest, exc: OperationalError) -> HttpResponse:
    if pool_exhausted(exc):
        return busy_response(request, api=True)
    return _unexpected(request, exc)


@api.exception_handler(Exception)
def _unexpected(request: HttpRequest, exc: Exception) -> HttpResponse:
    # Logged in full for the operator; the caller never sees a traceback, even with DEBUG.
    log.exception("API error on %s %s", request.method, request.path)
    return _detail(request, "internal error: the server log has the details", 500)
