"""The Celery app shared by the web app (which sends run tasks) and the workers (which run them).

No Django here: a worker machine has the broker and the web app's URL, never database
credentials. The broker comes from the environment:

- ``REDIS_URL`` (team deployment): Redis is the broker; no result backend is needed (the
  run's outcome travels over the ingest socket, not through Celery results).
- otherwise (embedded mode): kombu's ``filesystem://`` transport in
  ``$TRIBUTARY_DATA_DIR/broker``, which needs no server, with each message written whole before
  a consumer can see it (``jobs.file_broker``). Polling every 0.1 s picks a task up
  in ~50 ms instead of ~0.5 s.

A message a worker had taken is lost if that worker is killed with SIGKILL, even with late
acks (checked on this transport), so recovering lost runs is the web app's sweeper's job,
based on heartbeats, not the broker's. A message still waiting is lost when a Redis without
persistence restarts: the web app's reconciler (``webapp.runs.reconcile``) sends queued runs
whose message is gone again, and the exclusive claim of the ingest socket (``client/tributary/protocol.py``)
lets one supervisor start a run however many copies of its message are delivered.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery

from engine.paths import data_dir

SUPERVISE_TASK = "jobs.supervise_run"
DEFAULT_QUEUE = "cpu"


def broker_folder(environ: dict[str, str] | os._Environ[str] | None = None) -> Path:
    """The embedded broker's folder: ``TRIBUTARY_BROKER_DIR``, default ``<data dir>/broker``."""
    env = os.environ if environ is None else environ
    return Path(env.get("TRIBUTARY_BROKER_DIR", "") or data_dir() / "broker")


def broker_settings(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, Any]:
    """Celery settings for the broker named by the environment (see the module docstring)."""
    env = os.environ if environ is None else environ
    redis_url = env.get("REDIS_URL", "").strip()
    common: dict[str, Any] = {
        "task_default_queue": DEFAULT_QUEUE,
        "task_serializer": "json",
        "accept_content": ["json"],
        # One run at a time per worker process; a run may take days, so never prefetch more.
        "worker_prefetch_multiplier": 1,
        "task_acks_late": True,
        "task_ignore_result": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if redis_url:
        # visibility_timeout: a long run must not be redelivered to a second worker while the
        # first still runs it (Redis redelivers unacked messages after this many seconds).
        return {
            **common,
            "broker_url": redis_url,
            "broker_transport_options": {"visibility_timeout": 30 * 24 * 3600},
        }
    folder = broker_folder(env)
    for sub in ("queue", "processed", "control"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    return {
        **common,
        "broker_url": "filesystem://",
        # kombu's transport with each message file written whole (jobs/file_broker.py).
        "broker_transport": "jobs.file_broker:Transport",
        "broker_transport_options": {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            # Exchange bindings: else kombu writes them to ./control in the working directory.
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": 0.1,
        },
    }


def make_app(environ: dict[str, str] | None = None) -> Celery:
    app = Celery("tributary")
    app.conf.update(broker_settings(environ))
    app.conf.include = ["jobs.tasks", "jobs.housekeeping"]
    return app


app = make_app()
