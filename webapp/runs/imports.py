"""A finished verl run's files, uploaded from the project page, as an external run.

The files are read by the same code ``python -m tributary follow`` reads them with
(``tributary.integrations.verl.run_events``: verl's file logger JSONL and its
``trainer.rollout_data_dir`` dumps), and their events are stored through the ingest path
(``ingest.store_events``: validation, quarantine, the health rules, live announcements) as if
a script had shipped them: one run, its statuses starting, running and succeeded around them,
all in one transaction: a failure part-way leaves no half-imported run (an external run is never
swept, so it would stay "running").
"""

from __future__ import annotations

import time
from typing import Any

from django.db import transaction

from tributary.integrations.verl import Skipped, run_events
from webapp.runs.external import create_external_run
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
from webapp.teams.models import Project

STORE_BATCH = 200  # events per store_events call, as an ingest message


def import_verl_run(
    project: Project, user: Any, *, name: str, metrics: bytes | None, rollouts: dict[int, bytes]
) -> tuple[Run, Skipped]:
    """Create an external run in ``project`` holding the verl files' metrics and samples; what
    could not be taken is counted in the ``Skipped`` (and said in the run's final status)."""
    events, skipped = run_events(metrics, rollouts, time=time.time())
    files = (["metrics"] if metrics else []) + [f"{step}.jsonl" for step in sorted(rollouts)]
    config = {"source": "verl (uploaded files)", "files": files[:1000]}
    with transaction.atomic():
        run = _store(project, user, name, config, events, skipped)
    run.refresh_from_db()
    return run, skipped


def _store(
    project: Project,
    user: Any,
    name: str,
    config: dict[str, Any],
    events: list[dict[str, Any]],
    skipped: Skipped,
) -> Run:
    run, _ = create_external_run(project, user, name=name, config=config, tags=["verl"], client_id=None)
    who = getattr(user, "username", "someone")
    said = f"imported from verl's files: {len(events)} events; skipped {skipped.words()}"
    everything = [
        {"type": "status", "state": "starting", "message": f"uploaded by {who}"},
        {"type": "status", "state": "running", "message": "importing verl's files"},
        *events,
        {"type": "status", "state": "succeeded", "message": said[:2000]},
    ]
    numbered = [{"run": run.pk, "seq": seq, **event} for seq, event in enumerate(everything, start=1)]
    for start in range(0, len(numbered), STORE_BATCH):
        store_events(run.pk, numbered[start : start + STORE_BATCH])
    return run
