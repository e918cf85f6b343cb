"""The Celery task a worker runs for each queued run: supervise the engine and ship its events.

Sent by the web app (``webapp.runs.launch.queue_run``) to the queue the run names, with the
run id, the full validated config, a per-run ingest token, the web app's event cursor
(``start_seq``) and, for a resume, the checkpoint to start from. The run's outcome travels
over the ingest socket; the return value (a small dict) is for logs and tests only.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_shutting_down

from jobs.app import SUPERVISE_TASK
from jobs.supervisor import RunSupervisor, cancel_all

log = logging.getLogger(__name__)


# shared_task: registered on every Celery app that imports this module (jobs.app.app, and the
# apps tests build with jobs.app.make_app). acks_late: the message is acknowledged when the
# run ends, not when it starts.
@shared_task(name=SUPERVISE_TASK, bind=True, acks_late=True)
def supervise_run(
    self: Any,
    run_id: int,
    config: dict[str, Any],
    token: str,
    start_seq: int = 0,
    resume_path: str | None = None,
) -> dict[str, Any]:
    """Run one engine run to its end; returns ``RunResult.as_dict()`` (exit code, final state...)."""
    log.info("run %s: task %s received", run_id, getattr(self.request, "id", "?"))
    supervisor = RunSupervisor(run_id, config, token, start_seq=start_seq, resume_path=resume_path)
    return supervisor.run().as_dict()


@worker_shutting_down.connect
def _stop_runs_on_shutdown(sig: str = "", how: str = "", **_: Any) -> None:
    """A worker told to stop (SIGTERM, Ctrl-C) stops its runs the clean way: each engine
    checkpoints, its last events are shipped, then the task returns and the worker exits.

    Celery sends this signal in the worker's main process, where the runs are with the solo
    and threads pools (``python -m jobs.worker`` uses them); prefork children finish their run.
    """
    # Runs inside Celery's signal handler: cancel_all only flags the runs (signal-safe).
    cancel_all(f"the worker is shutting down ({how or 'Warm'} shutdown on {sig or 'a signal'})")
