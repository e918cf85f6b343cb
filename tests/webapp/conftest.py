"""Database fixtures and personas for the web app tests.

Every test here runs against a real database: SQLite by default and PostgreSQL when
``DATABASE_URL`` is set (``make test`` runs this directory once each way).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django import db
from django.db import connection

from webapp.live.consumers import STORE_THREADS, store_threads
from webapp.runs.models import Run
from webapp.runs.services import validate_run_config
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team


@pytest.fixture(autouse=True)
def _db(db: None) -> None:
    """Every web app test may use the database (each test in a rolled-back transaction)."""


def close_store_threads_connections() -> None:
    """Close the connection each ingest store thread holds (``consumers.store_in_thread``): one
    call a thread, each held at a barrier until every thread has one. Under ``channels.testing``
    ``close_old_connections`` is a no-op, so those threads keep theirs after a store, and
    PostgreSQL refuses to drop a test database with sessions open."""
    barrier = threading.Barrier(STORE_THREADS)

    def close() -> None:
        try:
            barrier.wait(30)
        finally:
            db.connections.close_all()

    for done in [store_threads.submit(close) for _ in range(STORE_THREADS)]:
        done.result()


@pytest.fixture(scope="session", autouse=True)
def _store_threads_closed(django_db_setup: None) -> Iterator[None]:
    """The store threads' connections closed before the test databases are dropped (whatever
    test left one open: a store that ended after its test's ``connections`` fixture)."""
    yield
    close_store_threads_connections()


@pytest.fixture
def on_postgres() -> bool:
    return connection.vendor == "postgresql"


@pytest.fixture
def team() -> Team:
    return Team.objects.create(name="Alignment", slug="alignment")


@pytest.fixture
def other_team() -> Team:
    return Team.objects.create(name="Other lab", slug="other-lab")


def _persona(django_user_model: Any, username: str, team: Team | None, role: Role | None) -> Any:
    user = django_user_model.objects.create_user(username=username)  # no password: hashing is slow by design
    if team is not None and role is not None:
        Membership.objects.create(user=user, team=team, role=role)
    return user


@pytest.fixture
def admin(django_user_model: Any, team: Team) -> Any:
    return _persona(django_user_model, "alice-admin", team, Role.ADMIN)


@pytest.fixture
def member(django_user_model: Any, team: Team) -> Any:
    return _persona(django_user_model, "bob-member", team, Role.MEMBER)


@pytest.fixture
def viewer(django_user_model: Any, team: Team) -> Any:
    return _persona(django_user_model, "carol-viewer", team, Role.VIEWER)


@pytest.fixture
def outsider(django_user_model: Any, other_team: Team) -> Any:
    """A member of another team, with no role in ``team``."""
    return _persona(django_user_model, "dave-outsider", other_team, Role.ADMIN)


@pytest.fixture
def project(team: Team) -> Project:
    return Project.objects.create(team=team, name="GSM8K", slug="gsm8k")


@functools.cache
def _grpo_config() -> dict[str, Any]:
    """The grpo preset as the engine validates it (what a launched run stores)."""
    return validate_run_config({"preset": "grpo", "name": "grpo-baseline"})


@pytest.fixture
def make_run(project: Project, member: Any) -> Callable[..., Run]:
    def make(**fields: Any) -> Run:
        fields.setdefault("name", "grpo-baseline")
        fields.setdefault("config", _grpo_config())
        return Run.objects.create(project=project, created_by=member, **fields)

    return make


@pytest.fixture
def run(make_run: Callable[..., Run]) -> Run:
    return make_run()


# --- API fixtures (tests/webapp/test_api_*.py) ------------------------------------------


@pytest.fixture
def client_for() -> Callable[..., Any]:
    """``client_for(user)``: a test client logged in as ``user`` (anonymous for None)."""
    from django.test import Client

    def make(user: Any = None, **kwargs: Any) -> Client:
        client = Client(**kwargs)
        if user is not None:
            client.force_login(user)
        return client

    return make


@pytest.fixture
def token_for() -> Callable[[Any], str]:
    """``token_for(user)``: the plaintext of a new personal API token of ``user``."""
    from webapp.api.models import ApiToken

    def make(user: Any) -> str:
        return ApiToken.issue(user, "tests")[1]

    return make


@pytest.fixture
def valid_config() -> dict[str, Any]:
    """A full config as the engine validates it (what a launched run stores)."""
    from webapp.runs.services import validate_run_config

    return validate_run_config({"name": "grpo-baseline", "trainer": {"total_steps": 50}})


@pytest.fixture
def api_run(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> Run:
    """A queued run of ``project`` with a valid config (so forks and resumes validate)."""
    return make_run(config=valid_config, tags=["baseline"])
