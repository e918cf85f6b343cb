"""Fixtures of the end-to-end tests: deployments of real processes (tests/e2e/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Deployment


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Any]:
    """``deployment(**settings)`` makes a ``Deployment`` in the test's directory; all of them are
    stopped afterwards and their logs printed (shown by pytest when the test failed)."""
    made: list[Deployment] = []

    def make(**settings: str) -> Deployment:
        made.append(Deployment(tmp_path, **settings))
        return made[-1]

    yield make
    for d in made:
        d.stop_all()
        print(d.logs())
