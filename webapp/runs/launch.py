"""Creating, queueing, cancelling, forking and resuming runs: the web app's side of a launch.

A config is validated by the engine's own schema before anything is stored or queued
(``RunConfigInvalid`` lists each bad field by its dotted path). The run is stored with the
full validated config, then, once the transaction commits, a ``jobs.supervise_run`` task is
sent to the queue the run names with a freshly signed ingest token. The worker answers
over the ingest socket, never through the database.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from django.db import transaction
from django.utils import timezone

from engine.config import ConfigError, build_config, deep_merge
from jobs.app import SUPERVISE_TASK
from jobs.registry import WorkerEntry
from webapp.live.groups import tell_worker_to_cancel
from webapp.runs import routing
from webapp.runs.choices import FINAL_STATUSES, ParentKind, RunStatus
from webapp.runs.models import Checkpoint, InvalidTransition, Run
from webapp.runs.tokens import ingest_token
from webapp.teams.models import Project

QUEUE_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")


class RunConfigInvalid(ValueError):
    """The config (or another launch field) does not validate; ``problems`` are (path, message)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


class CannotResume(ValueError):
    """The run has no checkpoint to resume from, or is still running."""


def validate_run_config(config: dict[str, Any]) -> dict[str, Any]:
    """The engine's validated config as plain JSON, or ``RunConfigInvalid`` naming each bad field."""
    if not isinstance(config, dict):
        raise RunConfigInvalid([("config", f"must be an object (a RunConfig), got {type(config).__name__}")])
    try:
        cfg = build_config(dict(config))
    except ConfigError as exc:
        raise RunConfigInvalid(
            [(f"config.{path}" if path else "config", msg) for path, msg in exc.problems]
        ) from None
    return cfg.model_dump(mode="json")


def _check_queue(queue: str) -> str:
    queue = (queue or "cpu").strip().lower()
    if not queue or len(queue) > 64 or set(queue) - QUEUE_CHARS:
        raise RunConfigInvalid(
            [
                (
                    "queue",
                    f"{queue!r} is not a queue name: use letters, digits, '-', '_' or '.' (e.g. cpu, gpu)",
                )
            ]
        )
    return queue


def create_run(
    project: Project,
    user: Any,
    config: dict[str, Any],
    *,
    name: str = "",
    queue: str = "cpu",
    tags: list[str] | None = None,
    notes: str = "",
    parent: Run | None = None,
    parent_kind: str = "",
    resume_from: Checkpoint | None = None,
    resume_path: str | None = None,
) -> Run:
    """Validate, store and queue a run; the task is sent after the transaction commits.

    ``resume_path`` overrides where the engine resumes from (default: ``resume_from.path``)."""
    validated = validate_run_config(config)
    workers = routing.live_workers()  # one registry read serves the queue choice and the waiting message
    queue = routing.resolve_queue(_check_queue(queue), validated, workers)
    name = (name or validated.get("name") or "run").strip()[:200]
    with transaction.atomic():
        run = Run.objects.create(
            project=project,
            created_by=user if getattr(user, "is_authenticated", False) else None,
            name=name,
            config=validated,
            queue=queue,
            tags=list(tags or []),
            notes=notes,
            parent=parent,
            parent_kind=parent_kind,
            resume_from=resume_from,
            # A resume numbers its own events from 1; its series continue after the step.
            last_step=resume_from.step if resume_from else 0,
        )
        transaction.on_commit(lambda: queue_run(run, resume_path=resume_path, workers=workers))
    return run


def queue_run(run: Run, *, resume_path: str | None = None, workers: list[WorkerEntry] | None = None) -> None:
    """Send the supervisor task for ``run`` to its queue, with a fresh ingest token; its status says
    why it waits when no online worker (``workers``, read from the registry if not given) can take it."""
    from jobs.app import app

    app.send_task(
        SUPERVISE_TASK,
        kwargs={
            "run_id": run.pk,
            "config": run.config,
            "token": ingest_token(run.pk),
            "start_seq": run.last_seq,
            "resume_path": resume_path or (run.resume_from.path if run.resume_from else None),
        },
        queue=run.queue,
    )
    routing.refresh_waiting(run, routing.live_workers() if workers is None else workers)


def request_cancel(run: Run, message: str = "") -> Run:
    """Cancel a run: at once when it is still queued, else by telling its worker.

    The worker stops the engine (SIGTERM, then SIGKILL after a grace period); the engine's
    own ``cancelled`` status event ends the run, with a checkpoint to resume from. A run
    already final is refused with ``InvalidTransition``.
    """
    message = message or "cancelled by a user"
    run.refresh_from_db()
    if RunStatus(run.status) in FINAL_STATUSES:
        raise InvalidTransition(run.pk, run.status, RunStatus.CANCELLED)
    if run.status == RunStatus.QUEUED:
        try:
            run.cancel(message)
            return run
        except InvalidTransition:  # a worker claimed it meanwhile: cancel through the worker
            run.refresh_from_db()
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())
    run.refresh_from_db()
    tell_worker_to_cancel(run.pk, message)
    return run


def fork_run(
    parent: Run, user: Any, changes: dict[str, Any] | None = None, *, name: str = "", queue: str = ""
) -> Run:
    """A new run from the parent's config with ``changes`` merged in (nested keys merge)."""
    config = deep_merge(parent.config, changes or {})
    return create_run(
        parent.project,
        user,
        config,
        name=name or f"{parent.name}-fork",
        queue=queue or parent.queue,
        tags=list(parent.tags),
        parent=parent,
        parent_kind=ParentKind.FORK,
    )


def resume_run(parent: Run, user: Any, checkpoint: Checkpoint | None = None, *, queue: str = "") -> Run:
    """A new child run that continues ``parent`` from ``checkpoint``, or by default from the
    newest checkpoint in the parent's checkpoint directory.

    The default looks on the worker's disk, not only at what the web app stored: a worker
    that went silent may have written checkpoints whose events never arrived (its engine
    checkpoints when the worker dies), and ``checkpoint.keep_last`` may already have pruned
    the newest one the web app knows. The parent must have stopped (failed, cancelled, lost
    or succeeded). Checkpoint paths are on the worker that wrote them: resuming on another
    machine needs the runs directory on shared storage (``TRIBUTARY_RUNS_DIR``).
    """
    parent.refresh_from_db()
    if RunStatus(parent.status) not in FINAL_STATUSES:
        raise CannotResume(f"run {parent.pk} is {parent.status}: cancel it first, then resume")
    resume_path = None
    if checkpoint is None:
        checkpoint = parent.checkpoints.order_by("-step", "-seq").first()
        if checkpoint is None:
            raise CannotResume(f"run {parent.pk} wrote no checkpoint; fork it to start again from step 0")
        resume_path = str(PurePosixPath(checkpoint.path).parent)  # the engine takes the newest there
    elif checkpoint.run_id != parent.pk:
        raise CannotResume(f"checkpoint {checkpoint.pk} is not one of run {parent.pk}'s")
    return create_run(
        parent.project,
        user,
        parent.config,
        name=f"{parent.name}-resume",
        queue=queue or parent.queue,
        tags=list(parent.tags),
        notes=parent.notes,
        parent=parent,
        parent_kind=ParentKind.RESUME,
        resume_from=checkpoint,
        resume_path=resume_path,
    )
