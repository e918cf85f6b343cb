"""The Celery task a worker runs for each queued run: supervise the engine and ship its events.

Sent by the web app (``webapp.runs.queueing.queue_run``) to the queue the run names, with the
run id, the full validated config, a per-run ingest token, the web app's event cursor
(``start_seq``) and, for a resume, the checkpoint to start from. The run's outcome travels
over the ingest socket; the return value (a small dict) is for logs and tests only.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from jobs.app import SUPERVISE_TASK
from jobs.capabilities import Capabilities, gpus_to_lend, missing, probe, requirements
from jobs.registry import RegistryHeartbeat, registry_from_env
from jobs.slots import SLOTS
from jobs.supervisor import RunSupervisor, cancel_all

log = logging.getLogger(__name__)

REQUEUE_ENV = "TRIBUTARY_REQUEUE_S"
"""Seconds before a run this worker cannot take now goes back to its queue (default 30)."""

# This process's worker: what it has (probed when it starts) and its registry heartbeat.
_worker: dict[str, Any] = {"capabilities": None, "heartbeat": None}


def this_worker(hostname: str = "", queues: list[str] | None = None, concurrency: int = 1) -> Capabilities:
    """The capabilities of this worker process (probed once)."""
    caps = _worker["capabilities"]
    if caps is None:
        caps = _worker["capabilities"] = probe(hostname or "worker", queues or [], concurrency)
        SLOTS.set_gpus([g.index for g in caps.gpus])
    return caps


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
    user_code: bool = False,
) -> dict[str, Any]:
    """Run one engine run to its end; returns ``RunResult.as_dict()`` (exit code, final state...).

    ``user_code``: the web app allows this run to name its own reward code (``module:function``
    outside the deployment's reward modules); the run is then never started unconfined."""
    log.info("run %s: task %s received", run_id, getattr(self.request, "id", "?"))
    caps = this_worker(getattr(self.request, "hostname", "") or "")
    need = requirements(config)
    reasons = missing(caps, need, gpus_free=SLOTS.free())
    gpus = None if reasons else SLOTS.acquire(run_id, gpus_to_lend(need, caps))
    if gpus is None:
        # Not a failure: the run waits in its queue for a worker that has what it needs (the
        # web app's run page says which, from the registry). Another worker may take it first.
        delay = float(os.environ.get(REQUEUE_ENV, "") or 30)
        log.warning(
            "run %s: %s cannot run it now (%s); back to the queue in %g s",
            run_id, caps.name, "; ".join(reasons) or "its GPUs are lent to other runs", delay,
        )  # fmt: skip
        raise self.retry(countdown=delay, max_retries=None)
    _beat()
    try:
        supervisor = RunSupervisor(
            run_id,
            config,
            token,
            start_seq=start_seq,
            resume_path=resume_path,
            gpus=gpus if caps.gpus else None,
            user_code=user_code,
        )
        return supervisor.run().as_dict()
    finally:
        SLOTS.release(run_id)
        _beat()


def _beat() -> None:
    heartbeat = _worker["heartbeat"]
    if heartbeat is not None:
        heartbeat.beat()


@worker_ready.connect
def _register_worker(sender: Any = None, **_: Any) -> None:
    """Probe this machine and keep its entry in the worker registry while the worker runs."""
    consumer = sender
    queues = sorted(q.name for q in getattr(getattr(consumer, "task_consumer", None), "queues", []) or [])
    concurrency = int(getattr(getattr(consumer, "controller", None), "concurrency", 1) or 1)
    caps = this_worker(getattr(consumer, "hostname", ""), queues, concurrency)
    caps.queues, caps.concurrency = queues, concurrency
    _worker["heartbeat"] = RegistryHeartbeat(registry_from_env(), caps, SLOTS.state).start()
    log.info(
        "worker %s: queues %s, %d CPUs, %d GPUs, backends %s",
        caps.name, ",".join(queues), caps.cpus, len(caps.gpus), ", ".join(f"{k} {v}" for k, v in caps.backends.items()),
    )  # fmt: skip


@worker_shutdown.connect
def _unregister_worker(**_: Any) -> None:
    heartbeat = _worker.pop("heartbeat", None)
    _worker["heartbeat"] = None
    if heartbeat is not None:
        heartbeat.stop()


@worker_shutting_down.connect
def _stop_runs_on_shutdown(sig: str = "", how: str = "", **_: Any) -> None:
    """A worker told to stop (SIGTERM, Ctrl-C) stops its runs the clean way: each engine
    checkpoints, its last events are shipped, then the task returns and the worker exits.

    Celery sends this signal in the worker's main process, where the runs are with the solo
    and threads pools (``python -m jobs.worker`` uses them); prefork children finish their run.
    """
    # Runs inside Celery's signal handler: cancel_all only flags the runs (signal-safe).
    cancel_all(f"the worker is shutting down ({how or 'Warm'} shutdown on {sig or 'a signal'})")
