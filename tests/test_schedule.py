"""``tests/schedule.py``: the order of the suite's files for xdist (longest first, starter files once
enough other work hides their build) and the durations it reads from pytest's report."""

from __future__ import annotations

import json

from tests import schedule
from tests.schedule import STARTER_LEAD_S, file_seconds, scheduled

REPORT = """
============================= slowest 5 durations =============================
135.94s setup    tests/engine/test_a.py::test_x[zero2]
83.93s call     tests/engine/test_b.py::test_y
1.50s teardown tests/engine/test_a.py::test_z
0.25s call     tests/webapp/test_c.py::TestK::test_w
(2 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_the_report_is_summed_per_file() -> None:
    assert file_seconds(REPORT) == {
        "tests/engine/test_a.py": 137.44,
        "tests/engine/test_b.py": 83.93,
        "tests/webapp/test_c.py": 0.25,
    }


def test_longest_first_and_unlisted_files_after_in_their_order() -> None:
    files = ["u1", "short", "u2", "long", "mid"]
    weight = {"short": 1.0, "long": 30.0, "mid": 5.0}
    assert scheduled(files, weight, set()) == ["long", "mid", "short", "u1", "u2"]


def test_starter_files_wait_for_the_lead_then_go_longest_first() -> None:
    lead = STARTER_LEAD_S
    weight = {"a": lead * 0.6, "b": lead * 0.5, "c": 10.0, "s1": 50.0, "s2": 80.0}
    order = scheduled(["c", "s1", "a", "s2", "b", "u"], weight, {"s1", "s2"})
    # a + b reach the lead: the starter files come next, longest first, then the rest.
    assert order == ["a", "b", "s2", "s1", "c", "u"]


def test_starter_files_go_last_when_the_rest_is_shorter_than_the_lead() -> None:
    assert scheduled(["s", "x", "y"], {"x": 3.0}, {"s"}) == ["x", "y", "s"]


def test_main_replaces_the_named_files_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"tests/engine/test_a.py": 9.0, "tests/other.py": 4.0}))
    monkeypatch.setattr(schedule, "DURATIONS", path)
    (tmp_path / "first.txt").write_text(REPORT)
    (tmp_path / "second.txt").write_text("  200.00s call     tests/engine/test_b.py::test_y\n")
    schedule.main([str(tmp_path / "first.txt"), str(tmp_path / "second.txt")])
    stored = json.loads(path.read_text())
    assert stored == {
        "tests/engine/test_b.py": 200.0,  # the longer of the two reports
        "tests/engine/test_a.py": 137.4,
        "tests/other.py": 4.0,  # not in a report: kept
        "tests/webapp/test_c.py": 0.2,
    }
    assert list(stored) == sorted(stored, key=lambda f: -stored[f])


def test_the_suites_durations_name_files_that_exist() -> None:
    from tests.schedule import DURATIONS

    root = DURATIONS.parents[1]
    assert {name for name in json.loads(DURATIONS.read_text()) if not (root / name).is_file()} == set()
