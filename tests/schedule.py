"""The order in which ``make test``'s two xdist workers take the suite's files, so that neither waits
idle while the other finishes a long file at the end.

``--dist loadfile`` hands whole files to whichever worker is nearly out of work, in the order of its
work queue, which pytest-xdist by default sorts by how many tests a file holds
(``--loadscope-reorder``). A count says little of a file's time here: ``tests/e2e/test_serve.py`` is
one test of ~70 s and went last in the first pass, and ``test_schemathesis.py`` (one test, ~90 s on
PostgreSQL) went last in the second, the other worker idle the whole time (2026-11-29: 82-83% of the
2 cores busy). The Makefile turns that reorder off and this plugin sorts the files longest first
(the LPT rule of scheduling: the tail is then made of the shortest files) by the seconds each took,
``tests/durations.json``; a file it does not list counts as short and keeps its place after the
listed ones.

Files with a test that needs a starter policy (``tests/starters.py``) wait until the files before
them add up to ``STARTER_LEAD_S`` seconds, the time the session's build of the starters takes beside
two workers, so that a worker does not sit on the build's lock; with less work than that in the
session, they go last.

``tests/durations.json`` is written by this module from pytest's ``--durations`` report (setup, call
and teardown summed per file; where a file ran in both passes the longer figure is kept)::

    .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=0 | tee d.txt
    .venv/bin/python -m tests.schedule d.txt [more reports...]
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
STARTER_LEAD_S = 1500.0
"""Test seconds (both workers' summed) before the first file that needs a starter policy: building
the arithmetic and countdown starters took 9 minutes of one core beside the two workers
(2026-11-29), about 1,100 seconds of the workers' tests; the rest is margin."""

_LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(\S+?\.py)(?:::|\s|$)")


def file_seconds(report: str) -> dict[str, float]:
    """Seconds per test file of a pytest ``--durations`` report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        if match := _LINE.match(line):
            seconds[match.group(2)] += float(match.group(1))
    return dict(seconds)


def load_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def scheduled(files: list[str], weight: dict[str, float], needs_starter: set[str]) -> list[str]:
    """``files`` longest first by ``weight`` (unlisted ones after, in their order), the ``needs_starter``
    ones placed where the files before them add up to ``STARTER_LEAD_S``."""
    by_weight = sorted(files, key=lambda f: -weight.get(f, 0.0))  # stable: unlisted files keep their order
    others = [f for f in by_weight if f not in needs_starter]
    waiting = [f for f in by_weight if f in needs_starter]
    done, out = 0.0, []
    for f in others:
        if waiting and done >= STARTER_LEAD_S:
            out += waiting
            waiting = []
        out.append(f)
        done += weight.get(f, 0.0)
    return out + waiting


@pytest.hookimpl(trylast=True)  # after the conftest's deselections
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def name(item: pytest.Item) -> str:  # as the --durations report names it
        path = item.path
        return str(path.relative_to(config.rootpath)) if path.is_relative_to(config.rootpath) else str(path)

    files = list(dict.fromkeys(name(item) for item in items))
    starter = {name(item) for item in items if item.get_closest_marker("starter")}
    rank = {f: i for i, f in enumerate(scheduled(files, load_durations(), starter))}
    items.sort(key=lambda item: rank[name(item)])  # stable: a file's tests keep their order


def main(paths: list[str]) -> None:
    """Replace the figures of the files these reports name (the longer of two reports' figures)."""
    fresh: dict[str, float] = {}
    for path in paths:
        for name, seconds in file_seconds(Path(path).read_text()).items():
            fresh[name] = max(seconds, fresh.get(name, 0.0))
    merged = load_durations() | {name: round(seconds, 1) for name, seconds in fresh.items()}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])), indent=1) + "\n")
    print(f"{DURATIONS}: {len(merged)} files, {sum(merged.values()):,.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
