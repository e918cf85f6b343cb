"""Fixtures of the end-to-end tests: deployments of real processes (tests/e2e/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import launch_chromium, tributary_playwright
from tests.e2e.harness import Deployment


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium under Playwright, one per test module."""
    gen = tributary_playwright()
    chromium = launch_chromium(next(gen))
    yield chromium
    chromium.close()
    gen.close()


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
