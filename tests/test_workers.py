"""The per-worker resources of ``tests/workers.py`` (``make test`` runs the suite on two xdist workers)."""

from __future__ import annotations

import pytest

from tests.workers import redis_url_for_worker, worker_number


@pytest.mark.parametrize(
    ("url", "number", "expected"),
    [
        ("redis://127.0.0.1:6379/15", 0, "redis://127.0.0.1:6379/15"),
        ("redis://127.0.0.1:6379/15", 1, "redis://127.0.0.1:6379/13"),  # not 14: tests/jobs/test_routing.py's
        (
            "redis://:secret@cache:6380/9?ssl_cert_reqs=none",
            2,
            "redis://:secret@cache:6380/5?ssl_cert_reqs=none",
        ),
        ("redis://127.0.0.1:6379", 0, "redis://127.0.0.1:6379/0"),
    ],
)
def test_each_worker_gets_its_own_redis_database(url: str, number: int, expected: str) -> None:
    assert redis_url_for_worker(url, number) == expected


def test_too_many_workers_for_the_databases_left_is_an_error_naming_the_url() -> None:
    with pytest.raises(ValueError, match=r"redis://127.0.0.1:6379/3.*worker 2"):
        redis_url_for_worker("redis://127.0.0.1:6379/3", 2)


@pytest.mark.parametrize(("name", "number"), [("gw0", 0), ("gw11", 11), ("", None), ("master", None)])
def test_worker_number(name: str, number: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", name)
    assert worker_number() == number
