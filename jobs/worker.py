"""Start a worker: ``python -m jobs.worker`` (extra arguments go to ``celery worker``).

- ``TRIBUTARY_QUEUES``: comma-separated queues this machine serves (default ``cpu``; e.g.
  ``gpu,cpu`` on a GPU machine).
- ``TRIBUTARY_WORKER_NAME``: the Celery node name (default ``tributary@<host name>``).
- ``TRIBUTARY_CONCURRENCY``: runs at a time on this machine (default 1). Runs execute in the
  worker's main process (pool ``solo`` for one, ``threads`` for more; each run is a subprocess
  anyway), so stopping the worker (SIGTERM) stops its runs cleanly: each engine checkpoints and
  its last events are shipped before the worker exits.

The worker needs the broker (``REDIS_URL``, or the embedded filesystem broker) and the web
app's URL (``TRIBUTARY_WEB_URL``); never database credentials.
"""

from __future__ import annotations

import os
import socket
import sys

from jobs.app import DEFAULT_QUEUE


def queues(environ: dict[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    names = [q.strip() for q in env.get("TRIBUTARY_QUEUES", DEFAULT_QUEUE).split(",") if q.strip()]
    return names or [DEFAULT_QUEUE]


def worker_argv(environ: dict[str, str] | None = None) -> list[str]:
    """``celery worker`` arguments for this machine, from the environment."""
    env = os.environ if environ is None else environ
    name = env.get("TRIBUTARY_WORKER_NAME", "").strip() or f"tributary@{socket.gethostname()}"
    concurrency = env.get("TRIBUTARY_CONCURRENCY", "").strip() or "1"
    if not concurrency.isdigit() or int(concurrency) < 1:
        raise SystemExit(f"TRIBUTARY_CONCURRENCY={concurrency!r} must be a whole number >= 1 (runs at a time)")
    concurrency = str(int(concurrency))
    return [
        "worker",
        "--hostname", name,
        "--queues", ",".join(queues(env)),
        "--pool", "solo" if concurrency == "1" else "threads",
        "--concurrency", concurrency,
        "--loglevel", env.get("TRIBUTARY_LOG_LEVEL", "INFO"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import logging

    from jobs.app import app
    from jobs.confine import make_undumpable

    # The worker holds the broker's credentials: keep its environment and memory out of the
    # runs' reach (jobs/confine.py).
    make_undumpable()

    # jobs.app leaves the root logger alone (worker_hijack_root_logger=False): show the
    # supervisors' and shippers' own lines next to Celery's.
    logging.basicConfig(level=os.environ.get("TRIBUTARY_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s")
    app.worker_main([*worker_argv(), *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
