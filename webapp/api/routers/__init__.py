"""The API's endpoints by area; ``webapp.api.api`` mounts them all under ``/api/``."""

from __future__ import annotations

from typing import Any

from webapp.api.schemas import ErrorOut, ValidationErrorOut

# Error responses documented in the OpenAPI document, by kind of endpoint.
READ: dict[int, Any] = {401: ErrorOut, 404: ErrorOut}
WRITE: dict[int, Any] = {401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 422: ValidationErrorOut}
