"""``@pytest.mark.starter("task", ...)``: a test that needs those built-in tasks' starter policies.

A starter policy is minutes of SFT on one core when the data directory has none. A session that
collects such a test starts building the missing ones at once, in a process of its own (on the
core the tests leave idle, or beside the other xdist worker), and runs those tests' files after
the others, so that nobody waits for the build. The tests that get there first wait for it on the
build's file lock (``engine.models.starter``); a failed build is rebuilt by them, its error in
the test's report. Loaded with ``-p tests.starters`` (pyproject's ``addopts``);
``tests/test_starters.py`` runs it in a pytest of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG = "starter-build.log"  # in the data directory

_BUILD: subprocess.Popen[bytes] | None = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "starter(*tasks): needs the starter policies of these built-in tasks; the session builds them "
        "in the background from its start and runs these tests' files last (tests/starters.py)",
    )


@pytest.hookimpl(trylast=True)  # after the conftest's deselections and pytest-django's order
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a test that needs a starter policy go last, so the build started below is done
    by then. Whole files move (xdist's --dist loadfile schedules a file where its first test is),
    and the order holds only with ``--no-loadscope-reorder`` (``make test``): by default xdist
    orders the files by their number of tests, which put one-test files of a minute last, beside
    an idle worker. Before them, pytest-django's order stands: the web app's ~1,000 short database
    tests first, light work beside the build. Measured on a fresh data directory, first pass: 20:53
    and 20:57 in xdist's order, 18:49 and 20:22 in this one, 20:01 with the web tests moved last
    (the heavy multi-process files then ran beside the build and were slower)."""
    needs = {item.path for item in items if item.get_closest_marker("starter")}
    items.sort(key=lambda item: item.path in needs)  # stable: the order inside each part is kept


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run count
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the starter policies the session's tests need, unless built already. One
    process builds (xdist's first worker, or the only pytest); its output, after a line naming
    its pid and tasks, is in ``starter-build.log`` in the data directory."""
    global _BUILD
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
    with (data / LOG).open("ab") as log:
        _BUILD = subprocess.Popen(
            [sys.executable, "-c", code, *missing],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.write(f"starter build pid {_BUILD.pid}: {' '.join(missing)}\n".encode())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A session that ends before its starter tests (``-x``, an interrupt) stops the build: on
    SIGINT it removes its temporary directory (``engine.models.starter._cached_build``)."""
    if _BUILD is not None and _BUILD.poll() is None:
        _BUILD.send_signal(signal.SIGINT)
        try:
            _BUILD.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _BUILD.kill()
            _BUILD.wait()
