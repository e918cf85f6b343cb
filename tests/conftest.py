"""Shared pytest fixtures.

- ``TRIBUTARY_DATA_DIR`` points at ``<repo>/.cache/test-data`` for the whole session (unless
  already set), so the starter policy is built once and reused by later test runs.
- ``tiny_model_dir``: a tiny Qwen2 model + tokenizer built locally by ``make_model``.
- ``@pytest.mark.starter("task", ...)``: the test needs those built-in tasks' starter policies
  (minutes of SFT on one core when the data directory has none). A session that collects such a
  test starts building them at once in a process of its own, on the core the tests leave idle or
  beside the other xdist worker, and runs their files last, so that nobody waits for the build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    # Files with a test that needs a starter policy go last (whole files: xdist's --dist loadfile
    # schedules a file where its first test is), so the build started below is done by then.
    needs = {item.path for item in items if item.get_closest_marker("starter")}
    items.sort(key=lambda item: item.path in needs)  # stable: the order inside each part is kept


_STARTER_BUILD: subprocess.Popen[bytes] | None = None


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run count
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the starter policies the session's ``starter``-marked tests need, unless
    built already. One process builds (xdist's first worker, or the only pytest); the tests that
    get there first wait for it on the build's file lock (``engine.models.starter``), and a
    failed build is rebuilt by them with its error in the test's report. Its output is in
    ``starter-build.log`` in the data directory."""
    global _STARTER_BUILD
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or session.config.option.collectonly:
        return
    tasks = sorted({t for item in session.items for m in item.iter_markers("starter") for t in m.args})
    if not tasks:
        return
    from engine.models.starter import starter_path

    missing = [t for t in tasks if not (starter_path(t, 1) / "starter.json").exists()]
    if not missing:
        return
    data = Path(os.environ["TRIBUTARY_DATA_DIR"])
    data.mkdir(parents=True, exist_ok=True)
    code = "import sys\nfrom engine.models import starter_policy\nfor t in sys.argv[1:]:\n    starter_policy(t, 1)\n"
    with (data / "starter-build.log").open("ab") as log:
        _STARTER_BUILD = subprocess.Popen(
            [sys.executable, "-c", code, *missing],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends before its starter tests (``-x``, an interrupt) stops the build: on
    SIGINT it removes its temporary directory (``engine.models.starter._cached_build``)."""
    if _STARTER_BUILD is not None and _STARTER_BUILD.poll() is None:
        _STARTER_BUILD.send_signal(signal.SIGINT)
        try:
            _STARTER_BUILD.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _STARTER_BUILD.kill()
