"""``tests/starters.py`` in a pytest of its own (pytester): which files run last, when the starter
build starts, and that a session ending first stops it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.starters import LOG, REPO_ROOT

pytest_plugins = ("pytester",)

FILES = {
    "test_a_needs": """
        import pytest

        def test_first_in_its_file():
            pass

        @pytest.mark.starter("arithmetic")
        def test_needs_the_starter():
            pass
    """,
    "test_b_plain": "def test_b():\n    pass\n",
    "test_c_plain": "def test_c():\n    pass\n",
}


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.Pytester:
    """Three test files, the plugin loaded, an empty data directory of their own."""
    monkeypatch.setenv("TRIBUTARY_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile(**FILES)
    return pytester


def run(inner: pytest.Pytester, *args: str) -> pytest.RunResult:
    return inner.runpytest_subprocess("-p", "tests.starters", "-p", "no:cacheprovider", "-v", *args)


def order(result: pytest.RunResult) -> list[str]:
    return re.findall(r"^(test_\w+\.py::\w+) PASSED", result.stdout.str(), flags=re.M)


def test_a_file_with_a_starter_test_runs_last_whole_and_its_build_is_stopped_with_the_session(
    inner: pytest.Pytester, tmp_path: Path
) -> None:
    result = run(inner)
    result.assert_outcomes(passed=4)
    assert order(result) == [
        "test_b_plain.py::test_b",
        "test_c_plain.py::test_c",
        "test_a_needs.py::test_first_in_its_file",  # the whole file moved, its order kept
        "test_a_needs.py::test_needs_the_starter",
    ]
    # The starter was missing: a build started, and the session ended long before it could finish,
    # so the session stopped it. Its process is gone, and it left nothing in the data directory.
    log = (tmp_path / "data" / LOG).read_text()
    pid = int(re.search(r"^starter build pid (\d+): arithmetic$", log, flags=re.M).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    starters = tmp_path / "data" / "starters"
    assert not starters.exists() or not [p for p in starters.rglob("starter.json")]


def test_no_build_when_the_starter_test_is_deselected_or_the_starter_is_there(
    inner: pytest.Pytester, tmp_path: Path
) -> None:
    run(inner, "-k", "not needs_the_starter").assert_outcomes(passed=3, deselected=1)
    assert not (tmp_path / "data" / LOG).exists()

    from engine.models.starter import starter_path

    built = starter_path("arithmetic", 1)  # under this test's TRIBUTARY_DATA_DIR
    assert built.is_relative_to(tmp_path / "data")
    built.mkdir(parents=True)
    (built / "starter.json").write_text("{}")  # what the plugin looks for
    run(inner).assert_outcomes(passed=4)
    assert not (tmp_path / "data" / LOG).exists()
