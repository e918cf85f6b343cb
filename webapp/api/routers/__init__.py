"""The API's endpoints by area; ``webapp.api.api`` mounts them all under ``/api/``."""

from __future__ import annotations

from typing import Annotated, Any

from ninja import Path

from webapp.api.schemas import ErrorOut, ValidationErrorOut
from webapp.inputs import BIGINT_MAX

# Error responses documented in the OpenAPI document, by kind of endpoint. Every operation may
# answer 400: text the database cannot store in the URL or the query string
# (``webapp.middleware``), or a body that is not JSON; and 503 when no database connection
# became free in time (``webapp.dbpool``).
BAD: dict[int, Any] = {400: ErrorOut, 503: ErrorOut}
# 429: too many failed token checks from the caller's address (webapp.api.auth).
AUTHED: dict[int, Any] = {**BAD, 401: ErrorOut, 429: ErrorOut}
"""An endpoint that takes no parameters (``/me``, ``/teams``)."""
READ: dict[int, Any] = {**AUTHED, 404: ErrorOut, 422: ValidationErrorOut}
"""An endpoint with an object id or query parameters: 404 for an object the caller may not see,
422 for a bad parameter."""
WRITE: dict[int, Any] = {**READ, 403: ErrorOut}

# Path ids: database ids (bigint) start at 1; anything else is a 422 naming the parameter.
Id = Annotated[int, Path(..., ge=1, le=BIGINT_MAX, description="Database id (1 .. 2^63-1).")]
