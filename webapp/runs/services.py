"""Creating, queueing, cancelling, forking and resuming runs, and a worker claiming one: the
logic that spans models (views and sockets parse, authorise and call these).

(The launch *page* is ``webapp.pages.launch``; starting the engine's ranks is
``engine.ranks``; queue placement is ``webapp.runs.placement``.)

A config is validated by the engine's own schema before anything is stored or queued
(``RunConfigInvalid`` lists each bad field by its dotted path). The run is stored with the
full validated config, then, once the transaction commits, a ``jobs.supervise_run`` task is
sent to the queue the run names with a freshly signed ingest token. The worker answers
over the ingest socket, never through the database.
"""

from __future__ import annotations

import json
import logging
from pathlib import PurePosixPath
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from engine.config import ConfigError, build_config, deep_merge
from engine.rewards.policy import RewardPolicy
from webapp.live import announce
from webapp.runs import placement, selectors
from webapp.runs.choices import FINAL_STATUSES, ParentKind, RunStatus
from webapp.runs.ingest import InvalidEvent, stale_attempt_reason, store_events
from webapp.runs.models import Checkpoint, InvalidTransition, Run, RunAttempt
from webapp.runs.queueing import queue_run, reward_policy_for
from webapp.runs.reconcile import broker_from_env, claim_order
from webapp.runs.tokens import TokenRejected
from webapp.teams.models import Project

log = logging.getLogger(__name__)

QUEUE_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")


class RunConfigInvalid(ValueError):
    """The config (or another launch field) does not validate; ``problems`` are (path, message)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


class ProjectArchived(ValueError):
    """No run is launched or resumed in an archived project (a link or a script may still reach it)."""

    def __init__(self, project: Project) -> None:
        super().__init__(
            f"project {project.team.slug}/{project.slug} is archived: restore it (its team's page, Archived "
            "view) to launch or resume runs in it"
        )


def check_project_open(project: Project) -> None:
    if project.archived_at is not None:
        raise ProjectArchived(project)


class CannotResume(ValueError):
    """The run has no checkpoint to resume from (or not the one asked for), or is still running."""


def validate_run_config(config: dict[str, Any], policy: RewardPolicy | None = None) -> dict[str, Any]:
    """The engine's validated config as plain JSON, or ``RunConfigInvalid`` naming each bad field.

    ``policy`` says which reward functions may be named; without one, only the registered
    rewards and the deployment's modules (never the web process's own environment's default,
    which allows anything, as the engine's CLI does)."""
    if not isinstance(config, dict):
        raise RunConfigInvalid([("config", f"must be an object (a RunConfig), got {type(config).__name__}")])
    if policy is None:
        policy = RewardPolicy.of_deployment(allow_any=False)
    try:
        cfg = build_config(dict(config), reward_policy=policy)
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
) -> Run:
    """Validate, store and queue a run (its attempt 1: ``Run.save``); the task is sent after the
    transaction commits. A resume is no new run: ``resume_run`` queues the same one again."""
    check_project_open(project)
    validated = validate_run_config(config, reward_policy_for(project, user))
    workers = placement.live_workers()  # one registry read serves the queue choice and the waiting message
    queue = placement.resolve_queue(_check_queue(queue), validated, workers)
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
        )
        # Open runs tables and landing pages list it at once, not at its first status change.
        announce.status_changed(run.pk)
        # robust with Redis: a broker that is down does not fail the launch; the run is stored as
        # queued and the reconciler (webapp.runs.reconcile) sends it once the broker is back. The
        # file broker's reconciler cannot see a missing message, so a failed write is an error.
        transaction.on_commit(lambda: queue_run(run, workers=workers), robust=broker_from_env().exact)
    return run


def request_cancel(run: Run, message: str = "") -> Run:
    """Cancel a run: at once when it is still queued, else by telling its worker.

    The worker stops the engine (SIGTERM, then SIGKILL after a grace period); the engine's
    own ``cancelled`` status event ends the run, with a checkpoint to resume from. A run
    already final is refused with ``InvalidTransition``.

    An external run's script is told the same way (``run.should_stop()``), and its own final
    status ends the run. A script that died cannot answer, and no sweeper marks an external run
    lost, so a second cancel of it ends the run here at once (``webapp.runs.external``).
    """
    message = message or "cancelled by a user"
    run.refresh_from_db()
    if RunStatus(run.status) in FINAL_STATUSES:
        raise InvalidTransition(run.pk, run.status, RunStatus.CANCELLED)
    if run.is_external and run.cancel_requested_at is not None:
        run.cancel(f"{message}: ended here, its script did not stop after the first cancel")
        # Ended here, not by its script: what the script sends from now on is refused
        # (``ingest.IngestClosed``, close 4410), so nothing lands in a run shown as cancelled.
        Run.objects.filter(pk=run.pk, final_seq=None).update(final_seq=F("last_seq"))
        run.refresh_from_db()
        announce.status_changed(run.pk)
        return run
    if run.status == RunStatus.QUEUED:
        try:
            run.cancel(message)
        except InvalidTransition:  # a worker claimed it meanwhile: cancel through the worker
            run.refresh_from_db()
        else:
            if run.is_external:
                # Its script may be connected already (hello read while queued, its attach not yet
                # handled): tell it, and take nothing more, as for a run ended here. Otherwise the
                # script trained on into a run shown as cancelled (seen: 1,000 TRL steps stored).
                Run.objects.filter(pk=run.pk, final_seq=None).update(final_seq=F("last_seq"))
                announce.cancel_requested(run.pk, message)
            announce.status_changed(run.pk)
            return run
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=timezone.now())
    run.refresh_from_db()
    announce.cancel_requested(run.pk, message)
    announce.status_changed(run.pk)  # open pages drop their Cancel button and say it is coming
    return run


def fork_run(
    parent: Run, user: Any, changes: dict[str, Any] | None = None, *, name: str = "", queue: str = ""
) -> Run:
    """A new run from the parent's config with ``changes`` merged in (nested keys merge)."""
    if parent.is_external:
        raise CannotResume(
            f"run {parent.pk} is an external run: its config is its script's, not an engine config, so it "
            "cannot be forked; launch an engine run, or run the script again"
        )
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


def store_dead_tail(run: Run) -> int:
    """Store the events a lost run's engine wrote that its worker never shipped; returns how many.

    Its worker died (that is why the run is lost), but the engine's log on disk is the source
    of truth and its engine went on long enough to checkpoint (it does when its supervisor
    dies). When this web process can read the run's own directory (``<runs dir>/<run id>``,
    as a worker would write it: the same machine, or shared storage), the events after the
    stored cursor are read as the worker would ship them (``tributary.shipper.EventLog``: complete
    lines only) and stored through the ingest path (idempotent; a status the lost run cannot
    take is kept as a log line). Only that directory is read, and only events of this run.
    """
    from jobs.supervisor import EVENTS_FILE, runs_dir
    from tributary.shipper import EventLog

    base = runs_dir() / str(run.pk)
    path = base / EVENTS_FILE
    try:
        if not path.is_file() or not path.resolve().is_relative_to(base.resolve()):
            return 0
    except OSError:
        return 0
    events_log = EventLog(path)
    stored = 0
    try:
        while True:
            run.refresh_from_db(fields=["last_seq"])
            batch = [json.loads(raw) for _, raw in events_log.read(run.last_seq)]
            mine = [e for e in batch if str(e.get("run")) == str(run.pk)]
            if not mine or len(mine) != len(batch):
                break  # nothing more, or a line of another run: stop at the last event of this one
            stored += len(store_events(run.pk, mine).events)
    except (OSError, ValueError, InvalidEvent, TokenRejected) as exc:
        log.warning("run %s: could not store the tail of %s: %s", run.pk, path, exc)
    finally:
        events_log.close()
    if stored:
        log.info("run %s: stored %d events its lost worker never shipped, from %s", run.pk, stored, path)
    return stored


def resume_run(run: Run, user: Any, checkpoint: Checkpoint | None = None, *, queue: str = "") -> Run:
    """Queue ``run`` again as its next attempt, from ``checkpoint`` or by default from its newest.

    The same run continues (one URL, one history, one row in the runs table): a new
    ``RunAttempt`` records when, from which checkpoint and, once a worker claims it, where; the
    run goes from its final status back to queued with its engine's final seq, claim and cancel
    request cleared, and keeps its last step, summary and event cursor, so the engine (in the
    same run directory, ``jobs.supervisor``) numbers its events after the stored ones. A
    checkpoint older than the run's last step is a rewind: once the new attempt's first step
    arrives, what earlier attempts recorded from that step on is superseded
    (``webapp.runs.ingest``).

    The default looks on the worker's disk, not only at what the web app stored: a worker that
    went silent may have written checkpoints whose events never arrived (its engine checkpoints
    when the worker dies), so the engine gets the checkpoint directory and takes the newest
    there, unless an earlier rewind left checkpoints of a superseded branch in it (then the
    newest stored one of the run's history, by path). The run must have stopped (failed,
    cancelled, lost or succeeded). Checkpoint paths are on the worker that wrote them: resuming
    on another machine needs the runs directory on shared storage (``TRIBUTARY_RUNS_DIR``).

    A lost run whose directory this machine holds (embedded mode, or a runs directory shared
    with the workers) first gets the events its engine wrote after the web app last heard from
    it (``store_dead_tail``): its last metrics and final checkpoint are stored, and the next
    attempt starts from that checkpoint.
    """
    run.refresh_from_db()
    if run.is_external:
        raise CannotResume(
            f"run {run.pk} is an external run: its own script trains it, so only the script can continue "
            "it (run it again with the same client_id while the run is active, or start a new run)"
        )
    if RunStatus(run.status) not in FINAL_STATUSES:
        raise CannotResume(f"run {run.pk} is {run.status}: cancel it first, then resume")
    check_project_open(run.project)
    if run.status == RunStatus.LOST:
        store_dead_tail(run)
        run.refresh_from_db()
    resume_path = ""
    if checkpoint is None:
        checkpoint = selectors.resumable_checkpoints(run).first()
        if checkpoint is None:
            raise CannotResume(f"run {run.pk} has no checkpoint to resume from; fork it to start again from step 0")
        if not run.checkpoints.filter(superseded=True).exists():
            resume_path = str(PurePosixPath(checkpoint.path).parent)  # the engine takes the newest there
    elif checkpoint.run_id != run.pk:
        raise CannotResume(f"checkpoint {checkpoint.pk} is not one of run {run.pk}'s")
    elif checkpoint.superseded:
        raise CannotResume(
            f"checkpoint {checkpoint.pk} (step {checkpoint.step}) is on a branch a later resume left "
            f"(its files may be overwritten): pick one of the run's current checkpoints"
        )
    elif checkpoint.deleted:
        raise CannotResume(
            f"checkpoint {checkpoint.pk} (step {checkpoint.step}) was deleted on the worker when a later one was "
            f"saved (checkpoint.keep_last keeps only the newest): pick one of the run's current checkpoints, "
            f"or set a larger checkpoint.keep_last in the next run to keep more"
        )
    # The stored config is the run's; it must still validate, and name only reward code the user
    # who resumes it may run (as at a launch). The queue is the run's unless another is named.
    validate_run_config(run.config, reward_policy_for(run.project, user))
    workers = placement.live_workers()
    queue = placement.resolve_queue(_check_queue(queue), run.config, workers) if queue else run.queue
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        number = locked.attempt_number + 1
        try:
            locked.transition(
                RunStatus.QUEUED,
                # Waiting words, which the queue's placement replaces with the run's place in the
                # queue once it is sent (``placement.refresh_waiting`` owns those words).
                message=placement.WAITING
                + f"resumed from the checkpoint of step {checkpoint.step} (attempt {number}); placing it in the queue",
                final_seq=None,
                claim="",
                cancel_requested_at=None,
                worker_host="",
                started_at=None,  # the latest attempt's start: this one has not started yet
                queue=queue,
                attempt_number=number,
                resume_from=checkpoint,
                resume_path=resume_path,
            )
        except InvalidTransition as exc:  # another request resumed it first
            raise CannotResume(f"run {run.pk} is no longer stopped: {exc}") from None
        RunAttempt.objects.create(
            run=locked,
            number=number,
            from_checkpoint=checkpoint,
            from_step=checkpoint.step,
            created_by=user if getattr(user, "is_authenticated", False) else None,
        )
        announce.status_changed(locked.pk)
        transaction.on_commit(lambda: queue_run(locked, workers=workers), robust=broker_from_env().exact)
    return locked


# --- a worker takes the run ------------------------------------------------------------


def note_worker_seen(run_id: int) -> Run | None:
    """The run, its worker noted as seen now (liveness: a connection is no progress); None when
    there is no such run."""
    Run.objects.filter(pk=run_id).update(worker_seen_at=timezone.now())
    return Run.objects.filter(pk=run_id).first()


def claim_run(
    run_id: int, host: str, claim: str = "", attempt: int | None = None, engine_from: int | None = None
) -> tuple[bool, str] | None:
    """A worker attached to the run's ingest socket: a queued run becomes starting on that host (the engine confirms).

    With a ``claim`` id (see ``client/tributary/protocol.py``) the start is exclusive and the answer is
    ``(won, why not)``: the conditional UPDATE queued -> starting records the claim, so of two
    supervisors holding copies of the run's message (a broker redelivery, a reconciler's re-send)
    exactly one wins; the winner reconnecting with the same claim keeps the run. Before that, the
    queue order is checked (``reconcile.claim_order``): an older queued run of the same queue
    that lost its message or waits behind this one goes first, and this run is queued again.
    Only the current ``attempt``'s supervisor can win (checked under the row lock): a copy of an
    older message (the run was sent again since) never starts it.
    Without a claim (a worker of before claims), the plain start of before, and None.
    """
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return (False, f"run {run_id} does not exist") if claim else None
    if not claim:
        if run.status == RunStatus.QUEUED:
            try:
                run.transition(RunStatus.STARTING, worker_host=host, message=placement.taken_by(host))
                announce.status_changed(run.pk)
                return None
            except InvalidTransition:  # cancelled meanwhile: the worker learns it from the status
                pass
        Run.objects.filter(pk=run_id).update(worker_host=host, worker_seen_at=timezone.now())  # liveness
        return None
    if run.status == RunStatus.QUEUED:
        if run.cancel_requested_at is None:  # a run about to be cancelled starts nothing: no order
            behind = claim_order(run)
            if behind:
                return False, f"not started now: {behind}"
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=run_id)
            if attempt is not None and run.attempt != attempt:
                return False, stale_attempt_reason(run_id, attempt, run.attempt)
            try:
                # The waiting message goes: the worker's and the engine's phases follow (issue 15).
                run.transition(
                    RunStatus.STARTING, worker_host=host, claim=claim, message=placement.taken_by(host)
                )
                if engine_from is not None:  # the seqs an earlier engine left in the log (ingest: its tail)
                    RunAttempt.objects.filter(run_id=run.pk, number=run.attempt_number).update(
                        engine_from_seq=engine_from
                    )
                announce.status_changed(run.pk)
                return True, ""
            except InvalidTransition:  # another supervisor won, or it was cancelled meanwhile
                pass
    if run.status != RunStatus.QUEUED and run.claim == claim:
        # The holder reconnecting: it keeps the run, to ship its tail even once the run is final.
        if not RunStatus(
            run.status
        ).is_final:  # liveness, not progress (a reconnect is no sign the engine trains)
            Run.objects.filter(pk=run_id, claim=claim).update(worker_host=host, worker_seen_at=timezone.now())
        return True, ""
    if run.status in (RunStatus.STARTING, RunStatus.RUNNING):
        return False, (
            f"run {run_id} is already {run.status} on {run.worker_host or 'another worker'} "
            "under another claim: this copy of its queue message starts nothing"
        )
    return False, f"run {run_id} is {run.status}: nothing to start"
