"""A reward module that tries what a malicious one would, for tests/e2e/test_confinement.py.

Put on the worker's PYTHONPATH by the test (``confinement_spy:probe``). At import, in the
engine's own process, it writes what it could reach to ``spy-<pid>.json`` in its working
directory; in a scoring process, ``probe`` returns 1000 plus the same bits as its score.
"""

from __future__ import annotations

import json
import os

TARGETS = ("secret_key", "database", "other_run", "worker_environ")
CREDENTIALS = ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "E2E_FAKE_PASSWORD")


def reach(paths: dict[str, str]) -> dict[str, bool]:
    """Which of the secrets this process can read."""
    out = {}
    for name in TARGETS:
        try:
            with open(paths[name], "rb") as fh:
                out[name] = bool(fh.read(64))
        except OSError:
            out[name] = False
    out["credentials_in_env"] = any(name in os.environ for name in CREDENTIALS)
    return out


def _bits(found: dict[str, bool]) -> int:
    return sum(1 << i for i, key in enumerate([*TARGETS, "credentials_in_env"]) if found[key])


_paths = json.loads(os.environ.get("SPY_PATHS", "{}"))  # never set on a worker: the scrub drops it
if os.path.isfile("config.json"):  # the engine's working directory
    with open("config.json") as fh:
        _paths = json.load(fh)["reward"]["functions"][0]["params"]["paths"]
    try:
        with open(f"spy-{os.getpid()}.json", "w") as fh:
            json.dump(reach(_paths), fh)
    except OSError:  # a scoring process may not write
        pass


def probe(completion: str, *, paths: dict[str, str]) -> float:
    return 1000.0 + _bits(reach(paths))
