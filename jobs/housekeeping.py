"""Removing a deleted run's files on the worker that holds them: the ``jobs.purge_run_files`` task.

The web app deletes a run's rows and, when it cannot reach the worker's runs directory itself
(no shared storage), sends this task to the run's queue (``webapp.runs.housekeeping``). The
message carries a run id, nothing else the worker acts on: the only path ever removed is
``runs_dir()/<id>``, checked to be a direct child of the runs directory after resolving links,
so no message can make a worker remove anything else. A symlink in its place is unlinked, never
followed. The web app, when it reaches the directory (embedded mode, shared storage), calls
``remove_run_directory`` itself.
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path
from typing import Any

from celery import shared_task

from jobs.supervisor import runs_dir

log = logging.getLogger(__name__)

PURGE_TASK = "jobs.purge_run_files"


def run_directory(run_id: object, root: Path) -> Path | None:
    """``root/<run_id>`` (``root`` resolved) for a positive integer id, else None."""
    if isinstance(run_id, bool) or not isinstance(run_id, int) or run_id <= 0:
        return None
    return root.resolve() / str(run_id)


def remove_run_directory(run_id: object, root: Path) -> bool:
    """Remove the run's directory under ``root``; True when there was one to remove."""
    target = run_directory(run_id, root)
    if target is None:
        raise ValueError(f"run id {run_id!r} is not a positive integer: nothing removed")
    if target.is_symlink() or target.is_file():
        target.unlink()  # a link in the run's place: the link goes, never what it points at
        return True
    if not target.exists():
        return False
    if target.resolve().parent != target.parent:  # not a direct child of the runs directory
        raise ValueError(f"{target} resolves outside {target.parent}: nothing removed")
    shutil.rmtree(target)
    return True


@shared_task(name=PURGE_TASK, acks_late=True)
def purge_run_files(run_id: int, host: str = "") -> dict[str, Any]:
    """Remove ``runs_dir()/<run_id>`` if this worker holds it. ``host`` is the machine that last
    ran the run (for the log line when the directory is not here)."""
    here = socket.gethostname()
    removed = remove_run_directory(run_id, runs_dir())
    if removed:
        log.info("run %s: deleted in the web app; removed its directory from %s", run_id, runs_dir())
    else:
        log.info(
            "run %s: deleted in the web app; %s holds no directory of it (it last ran on %s)",
            run_id, here, host or "no worker",
        )  # fmt: skip
    return {"run_id": run_id, "removed": removed, "host": here}
