"""Shared pytest fixtures.

- ``TRIBUTARY_DATA_DIR`` points at ``<repo>/.cache/test-data`` for the whole session (unless
  already set), so the starter policy is built once and reused by later test runs.
- ``tiny_model_dir``: a tiny Qwen2 model + tokenizer built locally by ``make_model``.
- ``@pytest.mark.starter("task", ...)`` is ``tests/starters.py``'s; the xdist workers' Redis
  databases and threads are ``tests/workers.py``'s (both loaded with ``-p``, pyproject's addopts).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set at import time (before any test module is collected) so that everything, including
# subprocesses started by tests, sees the same data directory.
os.environ.setdefault("TRIBUTARY_DATA_DIR", str(REPO_ROOT / ".cache" / "test-data"))


@pytest.fixture(scope="session")
def tributary_data_dir() -> Path:
    """The engine data directory used by this test session (starter policies are cached here)."""
    path = Path(os.environ["TRIBUTARY_DATA_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny (~0.1M-parameter) Qwen2 causal LM + tokenizer directory, random weights (seed 0)."""
    from engine.models import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", size="tiny", seed=0)


def on_postgresql() -> bool:
    """This pytest's web app database is PostgreSQL (``make test``'s second pass sets DATABASE_URL)."""
    return os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that must run in a process of their own (``@pytest.mark.child_only("VAR")``: the
    Triton interpreter, vLLM's process-wide settings) are collected only where ``VAR`` is "1"
    (the child pytest their ``@pytest.mark.parent_only("VAR")`` test starts); everywhere else
    they are deselected, not skipped, and the parent test is deselected inside the child.
    Likewise ``@pytest.mark.postgresql`` tests (PostgreSQL's own behaviour: its connection pool,
    terminating a backend) are collected only in the PostgreSQL pass of ``make test``."""
    keep, drop = [], []
    postgresql = on_postgresql()
    for item in items:
        child = item.get_closest_marker("child_only")
        parent = item.get_closest_marker("parent_only")
        inside = lambda m: os.environ.get(m.args[0]) == "1"  # noqa: E731
        wrong_database = item.get_closest_marker("postgresql") is not None and not postgresql
        if (child and not inside(child)) or (parent and inside(parent)) or wrong_database:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
