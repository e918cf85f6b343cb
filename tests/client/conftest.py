"""Fixtures of every client test module: ``server``, one real web app per module
(``tests/client/fixtures/server.py``)."""

from tests.client.fixtures.server import server  # noqa: F401 - the fixture
