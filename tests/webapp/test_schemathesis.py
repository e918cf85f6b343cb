"""Schemathesis against ``/api/openapi.json``: every operation, 50 generated examples each, no
server error and no status code the document does not list (issue 13, item 5).

The app is called in process through its WSGI handler (``schemathesis.openapi.from_wsgi``):
the requests go through the whole Django stack (middleware, URL resolution, ninja, the
views), inside the test's database transaction, so the populated world below is visible and
rolled back afterwards, on SQLite and on PostgreSQL alike. A live uvicorn server would need
its own committed database and adds nothing for input handling (``test_csv_export`` covers
what is ASGI-specific: streaming). The caller is the admin of a team with a project and a
run that holds metrics, samples, a checkpoint and share links, authenticated with a personal
API token; path ids are real ones half of the time, generated ones otherwise.

Bounded in time: 50 examples per operation on PostgreSQL, the production database, and 10 on
SQLite (``make test`` runs this file once on each: the full fuzz runs once, and embedded mode
still gets a smoke of every operation for what only SQLite does, such as its 64-bit integer
limit), with no per-example deadline (a loaded 2-core machine must not fail it);
``derandomize`` makes every run generate the same examples, so a failure reproduces and the
duration stays the same, as long as the same modules are loaded: Hypothesis also draws constants
found in the project's loaded modules (``hypothesis.internal.conjecture.providers``), so the
examples differ between this file run alone and inside the whole suite. Whether a read gets
through is therefore not left to the draw: each read is first sent once as a client would, with
the world's ids and no optional parameter, and must answer 2xx.

One test per operation, each in a world of its own: a failure names its operation, what one
operation's examples change (a deleted run, a revoked token) never reaches another's, and the
file's 47 tests are scheduled among the first files by xdist (it orders files by their number of
tests), where the single test of 50 examples x 47 operations (70 s on PostgreSQL) came last and
left the other worker idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connection
from hypothesis import HealthCheck, Phase, given, settings, strategies
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.webapp.world import World, build_world
from webapp.api.api import api as ninja_api
from webapp.api.models import ApiToken, hash_token

EXAMPLES = {"postgresql": 50, "sqlite": 10}
# The world's token gets an id no generated example is likely to hit, so that
# DELETE /api/tokens/{token_id} revokes the spare token (or nothing), not the one in use.
TOKEN_ID = 7_340_031_337
# The operations that never get the world's real ids, not even drawn by chance (a generated
# run_id of 1 is the world's run on a fresh database): deleting the world's run (the fuzz
# renames it to a generated name, then sends that name as the confirmation) would leave the
# operation's other examples only 404s.
NO_REAL_IDS = {"DELETE /api/runs/{run_id}"}
# Every operation of the document, read from the API object itself (no request needed).
OPERATIONS = [
    f"{method.upper()} {path}" for path, item in ninja_api.get_openapi_schema()["paths"].items() for method in item
]


@pytest.fixture
def world(django_user_model: Any) -> World:
    world = build_world(django_user_model)
    ApiToken.objects.filter(key_hash=hash_token(world.token)).update(id=TOKEN_ID)
    return world


def _real_ids(operation: Any, real: dict[str, Any]) -> dict[str, Any] | None:
    """The world's ids for the operation's path parameters, or None when it has none to take
    (no path parameter, one the world has no object for, or one of ``NO_REAL_IDS``)."""
    names = [p.name for p in operation.path_parameters]
    usable = names and all(n in real for n in names) and operation.label not in NO_REAL_IDS
    return {name: real[name] for name in names} if usable else None


def _strategy(operation: Any, real: dict[str, Any]) -> Any:
    """Valid and invalid requests alike (schemathesis' positive and negative modes); the path
    ids of the world's objects half of the time."""
    ids = _real_ids(operation, real)
    options = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for path_parameters in [None] if ids is None else [None, ids]:
            options.append(operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    cases = strategies.one_of(options)
    if operation.label in NO_REAL_IDS:
        world = {str(real[p.name]) for p in operation.path_parameters if p.name in real}
        cases = cases.filter(lambda case: not world & {str(v) for v in case.path_parameters.values()})
    return cases


@pytest.fixture
def keep_test_connection() -> Iterator[None]:
    """As Django's test client does: the WSGI handler would close the database connection after
    each request (``close_old_connections``), and with it the test's transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture(scope="module")
def api_schema(django_db_blocker: Any) -> Any:
    """The schema schemathesis reads from ``/api/openapi.json``, served by the app in process."""
    from webapp.wsgi import application

    with django_db_blocker.unblock():
        return schemathesis.openapi.from_wsgi("/api/openapi.json", application)


def test_the_document_lists_every_operation(api_schema: Any) -> None:
    """The fuzz below covers what the served document lists, and that is the whole API."""
    served = sorted(result.ok().label for result in api_schema.get_all_operations())
    assert served == sorted(OPERATIONS)
    assert len(OPERATIONS) >= 30, f"only {len(OPERATIONS)} operations in the document"


@pytest.mark.parametrize("label", OPERATIONS)
def test_api_conforms_to_its_openapi_document(
    label: str, api_schema: Any, world: World, keep_test_connection: None
) -> None:
    operation = api_schema.find_operation_by_label(label)
    headers = {"Authorization": f"Bearer {world.token}"}
    statuses: set[int] = set()
    real = _real_ids(operation, world.ids())
    if label.startswith("GET") and real is not None:
        response = operation.Case(path_parameters=real).call(headers=headers)
        assert 200 <= response.status_code < 300, f"the plain read answered {response.status_code}: {response.text[:500]}"
        statuses.add(response.status_code)

    @given(case=_strategy(operation, world.ids()))
    @settings(
        max_examples=EXAMPLES[connection.vendor],
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the failure is shown as sent
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        response = case.call_and_validate(headers=headers, checks=[not_a_server_error, status_code_conformance])
        statuses.add(response.status_code)

    check()
    # The authenticated caller got through to the data: a read succeeded at least once (a test
    # that only ever saw 401s and 404s would prove little). Reads without a path id rely on the
    # fuzz alone.
    if label.startswith("GET"):
        assert any(200 <= code < 300 for code in statuses), f"{label} never answered 2xx: {sorted(statuses)}"
