"""The API's endpoints as a table, and one way to call them, for the tests that sweep every endpoint
(authentication, team access): an endpoint added to the API is added here once."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

JSON = "application/json"

# Every endpoint that reaches an object of a team: (method, path, body).
TEAM_ENDPOINTS = [
    ("get", "/api/teams/{team}", None),
    ("get", "/api/teams/{team}/projects", None),
    ("post", "/api/teams/{team}/projects", {"name": "Sneaky"}),
    ("get", "/api/projects/{project}", None),
    ("get", "/api/projects/{project}/runs", None),
    ("post", "/api/projects/{project}/runs", {"config": {}}),
    ("get", "/api/runs/{run}", None),
    ("patch", "/api/runs/{run}", {"notes": "sneaky"}),
    ("post", "/api/runs/{run}/cancel", None),
    ("post", "/api/runs/{run}/resume", {}),
    ("post", "/api/runs/{run}/resume", {"checkpoint_id": "{checkpoint}"}),
    ("post", "/api/runs/{run}/fork", {"changes": {"trainer": {"total_steps": 3}}}),
    ("post", "/api/runs/{run}/ingest-token", None),
    ("post", "/api/runs/external", {"project": "gsm8k", "name": "sneaky"}),  # the project by its slug
    ("get", "/api/runs/{run}/checkpoints", None),
    ("get", "/api/runs/{run}/logs", None),
    ("get", "/api/runs/{run}/output", None),
    ("get", "/api/runs/{run}/output/full", None),
    ("get", "/api/runs/{run}/metrics", None),
    ("get", "/api/runs/{run}/metrics/series", None),
    ("get", "/api/runs/{run}/metrics.csv", None),
    ("get", "/api/runs/{run}/samples", None),
    ("get", "/api/runs/{run}/samples/steps", None),
    ("get", "/api/runs/{run}/shares", None),
    ("post", "/api/runs/{run}/shares", None),
    ("delete", "/api/runs/{run}/shares/{share}", None),
]


def fill(value: Any, ids: dict[str, int]) -> Any:
    """``value`` with its ``{placeholders}`` filled from ``ids`` (a lone placeholder becomes an int)."""
    if isinstance(value, str):
        return int(value.format(**ids)) if value.startswith("{") else value.format(**ids)
    if isinstance(value, dict):
        return {k: fill(v, ids) for k, v in value.items()}
    return value


def call(client: Client, method: str, path: str, body: Any, ids: dict[str, int]) -> Any:
    """One row of an endpoint table, its path and body filled from ``ids``; a body goes as JSON."""
    url = path.format(**ids)
    if body is None:
        return getattr(client, method)(url)
    return getattr(client, method)(url, fill(body, ids), content_type=JSON)


def over_endpoints(table: list[tuple[str, str, Any]]) -> pytest.MarkDecorator:
    """Parametrize a test with ``method, path, body`` over the rows of ``table``, named by them."""
    return pytest.mark.parametrize(("method", "path", "body"), table, ids=[f"{m} {p}" for m, p, _ in table])
