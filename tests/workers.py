"""What each pytest-xdist worker must have to itself when ``make test`` runs the suite on two.

Loaded with ``-p tests.workers`` (pyproject's ``addopts``), so it runs before pytest-django
reads the web app's settings (which read ``REDIS_URL`` once, at import). Nothing changes in a
run without xdist (``PYTEST_XDIST_WORKER`` unset), so ``pytest tests/...`` behaves as before.

- **Redis.** The PostgreSQL pass puts the Channels layer and the cache on ``REDIS_URL``. Each
  worker has a test database of its own (pytest-django appends ``_gw0``, ``_gw1``), so both hold a
  run 1: on one Redis database, a broadcast to run 1's group in one worker would reach the other's
  sockets, and throttling counters would add up across them. Worker ``n`` takes database
  ``base - 2n`` (15, 13, ...; 14 is ``tests/jobs/test_routing.py``'s).
- **Threads.** Two workers share the machine's cores: torch's default of one intra-op thread per
  core would put four spinning threads on two cores, and a test then runs several times slower
  (measured: the learning tests take 400-540 s instead of ~45 s beside another busy process).
  One thread per worker, and per process a test starts (the environment is inherited), keeps
  each on a core. A test that needs more sets its own (``torch.set_num_threads``).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit


def worker_number() -> int | None:
    """0 for xdist's ``gw0``, 1 for ``gw1``, ...; None outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


def redis_url_for_worker(url: str, number: int) -> str:
    """``url`` on database ``base - 2 * number`` (its own path's number, 0 when it has none)."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    base = int(path) if path.isdigit() else 0
    database = base - 2 * number
    if database < 0:
        raise ValueError(
            f"REDIS_URL {url!r} leaves no Redis database for xdist worker {number}: start from a higher one"
        )
    return urlunsplit(parts._replace(path=f"/{database}"))


_number = worker_number()
if _number is not None:
    if os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = redis_url_for_worker(os.environ["REDIS_URL"], _number)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
