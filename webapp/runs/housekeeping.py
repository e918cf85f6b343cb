"""A run's housekeeping by its team: rename, archive and restore (members), delete (admins).

Archiving hides a finished run from the runs table and the landing page (``listed`` /
``archived`` are the filters both use); nothing is removed and the run keeps its URL. A run
that is queued or running is neither archived nor deleted: it is in use (cancel it first). Should
an archived run be queued again (resumed), the lists show it while it is active.

Deleting purges everything the run holds: its metric points, samples, log lines, checkpoints,
share links (rows), then its files. The files are the worker's run directory,
``jobs.supervisor.runs_dir()/<run id>`` (events, engine log, checkpoints):

- when the web app reaches that directory (embedded mode, or ``TRIBUTARY_RUNS_DIR`` on storage
  shared with the workers) it removes it itself, once the rows' deletion committed;
- otherwise it sends ``jobs.purge_run_files`` to the run's queue, and the worker that takes it
  removes the directory if it holds it (``jobs.housekeeping``: only a direct child of its runs
  directory named by the run id, never a path from the message). With several workers on one
  queue and no shared storage, the message reaches one of them: the directory on another
  machine stays until that worker's disk is cleaned (the run's ``worker_host`` is logged).

A run that an active run resumes from (its checkpoints are that run's starting point) is not
deleted either. Open pages of a deleted run are told (their sockets close as revoked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from jobs.app import app as celery_app
from webapp.live import announce
from webapp.live.groups import run_group
from webapp.runs.choices import ACTIVE_STATUSES, ParentKind, RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, OutputLine, Run, Sample, ShareLink
from webapp.runs.output import full_log_path
from webapp.teams.choices import Role

log = logging.getLogger(__name__)

NAME_MAX = Run._meta.get_field("name").max_length or 200

# Who may do what to a run, by role in its team (each role can do what the ones before it can).
ACTION_ROLES: dict[str, Role] = {"rename": Role.MEMBER, "archive": Role.MEMBER, "delete": Role.ADMIN}


class Refused(Exception):
    """The change was refused; ``field`` is the form field at fault ("" when it is the run's
    state), the message says why and what to do."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def allowed(role: Role | str | None, action: str) -> bool:
    return role is not None and Role(role).at_least(ACTION_ROLES[action])


def actions_for(run: Run, role: Role | str | None) -> dict[str, bool]:
    """What the run page offers ``role`` now: the role's rights and the run's state together."""
    final = RunStatus(run.status) not in ACTIVE_STATUSES
    return {
        "rename": allowed(role, "rename"),
        "archive": allowed(role, "archive") and final and run.archived_at is None,
        "restore": allowed(role, "archive") and run.archived_at is not None,
        # Offered while active too: its page says why it must be cancelled first.
        "delete": allowed(role, "delete"),
    }


# --- the lists ---------------------------------------------------------------------------------

_LISTED = Q(archived_at=None) | Q(status__in=ACTIVE_STATUSES)


def listed(qs: QuerySet[Run]) -> QuerySet[Run]:
    """The runs the lists show by default: not archived (or archived but active again)."""
    return qs.filter(_LISTED)


def archived(qs: QuerySet[Run]) -> QuerySet[Run]:
    """The runs the lists' Archived filter shows."""
    return qs.exclude(_LISTED)


# --- rename, archive, restore ------------------------------------------------------------------


def clean_name(raw: object) -> str:
    name = " ".join(str(raw or "").split())
    if not name:
        raise Refused("name: give the run a name (letters, digits, punctuation).", "name")
    if len(name) > NAME_MAX:
        raise Refused(f"name: at most {NAME_MAX} characters (this one has {len(name)}): shorten it.", "name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise Refused("name: no control characters: use letters, digits, spaces and punctuation.", "name")
    return name


def rename_run(run: Run, raw_name: object) -> Run:
    run.name = clean_name(raw_name)
    Run.objects.filter(pk=run.pk).update(name=run.name)
    return run


def _in_use(run: Run) -> str:
    """Why ``run`` is in use now ("" when it is not): queued or running."""
    status = RunStatus(run.status)
    if status in ACTIVE_STATUSES:
        return f"run {run.pk} is {status.value}: cancel it first (or wait until it ends)"
    return ""


def archive_run(run: Run) -> Run:
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run.pk)
        busy = _in_use(run)
        if busy:
            raise Refused(f"Cannot archive: {busy}, then archive it.")
        if run.archived_at is None:
            run.archived_at = timezone.now()
            run.save(update_fields=["archived_at"])
    return run


def restore_run(run: Run) -> Run:
    Run.objects.filter(pk=run.pk).update(archived_at=None)
    run.archived_at = None
    return run


# --- delete --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holdings:
    """What deleting a run removes (the confirmation page lists it)."""

    metric_points: int
    samples: int
    log_lines: int
    checkpoints: int
    checkpoint_bytes: int
    share_links: int


def holdings(run: Run) -> Holdings:
    # The checkpoints still on the worker's disk: those the engine deleted already are not removed again.
    ckpt = Checkpoint.objects.filter(run=run, deleted_at_seq__isnull=True).aggregate(n=Count("id"), b=Sum("bytes"))
    return Holdings(
        metric_points=MetricPoint.objects.filter(run=run).count(),
        samples=Sample.objects.filter(run=run).count(),
        log_lines=LogLine.objects.filter(run=run).count() + OutputLine.objects.filter(run=run).count(),
        checkpoints=ckpt["n"] or 0,
        checkpoint_bytes=ckpt["b"] or 0,
        share_links=ShareLink.objects.filter(run=run).count(),
    )


def _dependants(run: Run) -> list[Run]:
    """Active runs that start from this run's checkpoints."""
    return list(
        Run.objects.filter(status__in=ACTIVE_STATUSES)
        .filter(Q(resume_from__run=run) | Q(parent=run, parent_kind=ParentKind.RESUME))
        .exclude(pk=run.pk)
        .only("id", "name", "status")
        .distinct()
    )


@dataclass(frozen=True)
class Purged:
    run_id: int
    name: str
    held: Holdings
    files: str  # where the run directory goes: "removed here" or "sent to queue <q>"


def delete_run(run: Run, confirmation: object) -> Purged:
    """Delete the run and everything it holds, if ``confirmation`` is its name (typed again).

    The rows go in one transaction with the run's row locked (a worker's claim cannot slip in
    between the check and the delete); the files once that commits (see the module docstring)."""
    typed = " ".join(str(confirmation or "").split())
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(pk=run.pk).first()
        if locked is None:
            raise Refused(f"run {run.pk} was already deleted.")
        if typed != locked.name:
            raise Refused(f"confirm: type the run's name exactly ({locked.name}) to delete it.", "confirm")
        busy = _in_use(locked)
        if busy:
            raise Refused(f"Cannot delete: {busy}, then delete it.")
        blocking = _dependants(locked)
        if blocking:
            names = ", ".join(f"{r.name} (#{r.pk}, {r.status})" for r in blocking[:5])
            raise Refused(
                f"Cannot delete: {names} resume{'s' if len(blocking) == 1 else ''} from this run's "
                "checkpoints: cancel it or wait until it ends, then delete this run."
            )
        held = holdings(locked)
        # Children and runs resumed from its checkpoints keep their rows, not their links to it.
        for model in (MetricPoint, Sample, LogLine, OutputLine, ShareLink):
            model.objects.filter(run=locked).delete()
        Run.objects.filter(resume_from__run=locked).update(resume_from=None)
        # A child's parent link goes with its kind (the model's constraint: both or neither).
        Run.objects.filter(parent=locked).update(parent=None, parent_kind="")
        Checkpoint.objects.filter(run=locked).delete()
        run_id, queue, host, external = locked.pk, locked.queue, locked.worker_host, locked.is_external
        locked.delete()
        announce.access_changed(run_group(run_id), "the run was deleted")
        here = not external and _reachable(run_id)
        # Files only once the rows are gone for good: a rolled-back delete keeps its checkpoints.
        transaction.on_commit(lambda: _remove_full_log(run_id))
        if external:
            pass  # its script's files are on the user's machine: no worker holds any
        elif here:
            transaction.on_commit(lambda: _remove_here(run_id))
        else:
            transaction.on_commit(lambda: _ask_worker(run_id, queue, host))
    files = (
        "none on a worker (an external run)"
        if external
        else "removed here"
        if here
        else f"sent to queue {queue}"
    )
    return Purged(run_id=run_id, name=locked.name, held=held, files=files)


def _reachable(run_id: int) -> bool:
    """Whether this process sees the run's directory (embedded mode, shared storage)."""
    from jobs.housekeeping import run_directory  # the worker's modules, loaded when needed
    from jobs.supervisor import runs_dir

    local = run_directory(run_id, runs_dir())
    return local is not None and (local.exists() or local.is_symlink())


def _remove_here(run_id: int) -> None:
    from jobs.housekeeping import remove_run_directory
    from jobs.supervisor import runs_dir

    try:
        removed = remove_run_directory(run_id, runs_dir())
    except (OSError, ValueError):  # after the commit: the run is gone either way; say what stayed
        log.exception("run %s: deleted, but its directory in %s could not be removed", run_id, runs_dir())
        return
    if removed:
        log.info("run %s: removed its directory from %s", run_id, runs_dir())


def _remove_full_log(run_id: int) -> None:
    """The web app's own copy of the engine's output (``webapp.runs.output``), always here."""
    try:
        full_log_path(run_id).unlink(missing_ok=True)
    except OSError:
        log.exception(
            "run %s: deleted, but its full log %s could not be removed", run_id, full_log_path(run_id)
        )


def _ask_worker(run_id: int, queue: str, host: str) -> None:
    from jobs.housekeeping import PURGE_TASK

    try:
        celery_app.send_task(PURGE_TASK, kwargs={"run_id": run_id, "host": host}, queue=queue)
    except Exception:  # the broker is down: the rows are gone either way; say where the files are
        log.exception("run %s: could not ask a worker of queue %s to remove its directory (last on %s)",
                      run_id, queue, host or "no worker")  # fmt: skip
        return
    log.info("run %s: asked a worker of queue %s to remove its directory (last on %s)", run_id, queue, host)
