from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from webapp.runs.choices import FINAL_STATUSES, TRANSITIONS, LogLevel, ParentKind, RunOrigin, RunStatus
from webapp.teams.models import Project, Team


class DoublesDecoder(json.JSONDecoder):
    """Reads a JSON document whose every number is a double (a run's summary: the last value of
    each metric, stored as the float ingest checked it into).

    PostgreSQL's jsonb keeps a number as ``numeric`` and prints it without an exponent: 1.7e308 comes
    back as 309 digits and 1e16 as ``10000000000000000``, which ``json`` reads as integers (the API
    then answered an integer, the CSV a 309-digit one). Every integer literal here is such a double."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["parse_int"] = float
        super().__init__(*args, **kwargs)


class InvalidTransition(Exception):
    """A run status change the state machine refuses; nothing was written."""

    def __init__(self, run_id: int | None, current: str, requested: str, reason: str = "") -> None:
        self.run_id, self.current, self.requested = run_id, str(current), str(requested)
        if not reason:
            allowed = sorted(s.value for s in TRANSITIONS[RunStatus(current)])
            reason = (
                f"{self.current!r} is final: only a resume queues it again"
                if RunStatus(current) in FINAL_STATUSES
                else f"from {self.current!r} it can go to {', '.join(allowed)}"
            )
        super().__init__(f"run {run_id}: cannot go from {self.current!r} to {self.requested!r}: {reason}")


class TransitionConflict(InvalidTransition):
    """The row changed underneath (another worker or request moved the run first)."""


class Run(models.Model):
    name = models.CharField(max_length=200)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="runs")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs"
    )
    config = models.JSONField(
        default=dict,
        help_text="An engine run's RunConfig, validated by the engine's schema; an external run's "
        "free-form config from its script (bounded, never validated or executed).",
    )
    tags = models.JSONField(default=list, blank=True)
    notes = models.TextField(blank=True)

    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    status_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(
        default=timezone.now,
        help_text="When it was last queued (its launch or its latest resume): its place in the queue's order.",
    )
    started_at = models.DateTimeField(null=True, blank=True, help_text="When the latest attempt started.")
    finished_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Last progress: an engine event stored (its heartbeats included) or the run claimed.",
    )
    worker_seen_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Last time the worker's socket spoke (connect, ping): liveness, not progress.",
    )
    worker_host = models.CharField(max_length=255, blank=True)
    claim = models.CharField(
        max_length=64,
        blank=True,
        help_text="The claim id of the supervisor that won the run's start: only it may start the engine.",
    )
    attempt = models.PositiveIntegerField(
        default=0,
        help_text="How many times the run was queued; only the current attempt's ingest token is accepted.",
    )
    final_seq = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="Seq of the engine's final status event: ingest accepts no event after it.",
    )
    queue = models.CharField(max_length=64, default="cpu")
    attempt_number = models.PositiveIntegerField(
        default=1,
        help_text="The number of the run's current RunAttempt (1 for its launch, + 1 for each resume); "
        "its events are stored under it.",
    )

    origin = models.CharField(
        max_length=16,
        choices=RunOrigin.choices,
        default=RunOrigin.ENGINE,
        help_text="engine: a worker runs Tributary's engine; external: the user's own script trains "
        "and ships its events (no queue, no worker).",
    )
    client_id = models.UUIDField(
        null=True,
        blank=True,
        help_text="An external run's id chosen by its script: creating it again with the same id in "
        "the same project returns this run (a restarted script, a retried request).",
    )
    client_pid = models.PositiveIntegerField(
        null=True, blank=True, help_text="An external run's script's process id, from its ingest attach."
    )

    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    parent_kind = models.CharField(max_length=16, choices=ParentKind.choices, blank=True)

    last_step = models.IntegerField(default=0)
    summary = models.JSONField(
        default=dict, blank=True, decoder=DoublesDecoder, help_text="Last value of each metric."
    )
    last_seq = models.BigIntegerField(default=0, help_text="Ingest cursor: highest event seq stored.")
    # The engine's output (engine.log, webapp.runs.output): a byte cursor of its own, per stream.
    output_stream = models.CharField(
        max_length=200,
        blank=True,
        help_text="The worker's output file (host:device:inode) output_bytes is of.",
    )
    output_bytes = models.BigIntegerField(
        default=0, help_text="Output cursor: the byte of that file up to which the output is stored."
    )
    output_file_bytes = models.BigIntegerField(
        default=0,
        help_text="Bytes of output received for the run's full log: the byte space of its lines' offsets.",
    )
    output_kept_bytes = models.BigIntegerField(
        default=0,
        help_text="Committed length of the full log file the web app keeps (equal to output_file_bytes "
        "until it reached FULL_LOG_MAX_MB and stopped growing).",
    )
    output_lines_dropped = models.BigIntegerField(
        default=0,
        help_text="Output lines deleted to keep the newest OUTPUT_LINES_KEPT (the full log has them).",
    )
    resume_from = models.ForeignKey(
        "Checkpoint",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="resumed_by",
        help_text="The checkpoint the current attempt resumes from (for a child run of before resumes "
        "continued the same run: its parent's).",
    )
    resume_path = models.TextField(
        blank=True,
        help_text="Where the engine resumes from when not resume_from's own path (the run's checkpoint "
        "directory: the newest there); kept so a queue message can be sent again.",
    )
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="A user asked to cancel; the worker is told on its socket."
    )
    archived_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Set: hidden from the runs table and the landing page unless asked for; restorable.",
    )
    # Health alerts (webapp.alerts): kept on the row ingest already locks and updates, so the
    # rules cost no query of their own per batch (bench/alerts.py).
    alert_state = models.JSONField(
        default=dict, blank=True, help_text="Each health rule's state between batches."
    )
    alert_overrides = models.JSONField(
        default=dict,
        blank=True,
        help_text="This run's health rule settings over its project's: {rule: {...}}.",
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # A project's runs table, filtered by status, newest first.
            models.Index(fields=["project", "status", "-created_at"], name="run_project_status_created"),
            models.Index(fields=["project", "-created_at"], name="run_project_created"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(parent__isnull=True, parent_kind="")
                | models.Q(parent__isnull=False, parent_kind__in=ParentKind.values),
                name="run_parent_has_kind",
            ),
            models.UniqueConstraint(
                fields=["project", "client_id"],
                condition=models.Q(client_id__isnull=False),
                name="run_one_per_project_client_id",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    def get_absolute_url(self) -> str:
        return reverse("run", kwargs={"run_id": self.pk})

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new run is saved with its first attempt, so every run has the attempt its events
        are stored under (the launch, or for a run of before resumes continued the same run, a
        child's start from its parent's checkpoint)."""
        adding = self._state.adding
        super().save(*args, **kwargs)
        if adding:
            final = RunStatus(self.status) in FINAL_STATUSES  # stored already ended (imported, seeded)
            RunAttempt.objects.create(
                run=self,
                number=self.attempt_number,
                created_by_id=self.created_by_id,
                from_checkpoint_id=self.resume_from_id,
                from_step=self.resume_from.step if self.resume_from_id else None,
                started_at=self.started_at,
                ended_at=self.finished_at if final else None,
                worker_host=self.worker_host,
                status=self.status if final else "",
                message=self.status_message if final else "",
            )

    # --- the state machine -------------------------------------------------------------
    def transition(self, to: RunStatus | str, *, message: str | None = None, **fields: Any) -> None:
        """Move the run to ``to`` with an atomic conditional UPDATE.

        Raises ``InvalidTransition`` when the state machine refuses the change, and
        ``TransitionConflict`` when the row is no longer in the status this instance holds
        (another worker got there first); in both cases nothing is written. ``fields`` are
        other columns to set in the same UPDATE (``worker_host=...``).

        The model knows no sockets: the service that moves a run announces the change
        (``webapp.live.announce.status_changed``), once it commits.
        """
        current = RunStatus(self.status)
        target = RunStatus(to)
        if not current.can_become(target):
            raise InvalidTransition(self.pk, current, target)
        now = timezone.now()
        updates: dict[str, Any] = {"status": target, **fields}
        if message is not None:
            updates["status_message"] = message
        if target == RunStatus.STARTING:
            updates["started_at"] = now
            updates["heartbeat_at"] = now
        elif target in FINAL_STATUSES:
            updates["finished_at"] = now
        elif target == RunStatus.QUEUED:  # a resume: no longer finished, and behind what waits already
            updates["finished_at"] = None
            updates["queued_at"] = now
        changed = Run.objects.filter(pk=self.pk, status=current).update(**updates)
        if not changed:
            now_status = Run.objects.filter(pk=self.pk).values_list("status", flat=True).first()
            raise TransitionConflict(
                self.pk,
                current,
                target,
                f"the run is no longer {current.value!r} but {now_status!r}: another worker or request got there first",
            )
        for name, value in updates.items():
            setattr(self, name, value)
        self._note_on_attempt(target, now)

    def _note_on_attempt(self, target: RunStatus, now: Any) -> None:
        """The current attempt's record follows the run: who started it, when and how it ended.
        Done in the same place as the run's own change, so no path (ingest, cancel, the sweeper)
        can move the run without its attempt."""
        attempt = RunAttempt.objects.filter(run_id=self.pk, number=self.attempt_number)
        if target == RunStatus.STARTING:
            attempt.update(started_at=now, worker_host=self.worker_host)
        elif target in FINAL_STATUSES:
            attempt.update(ended_at=now, status=target, message=self.status_message)

    def start(self, worker_host: str) -> None:
        """A worker claims the queued run; only one of several competing workers wins."""
        self.transition(RunStatus.STARTING, worker_host=worker_host)

    def cancel(self, message: str = "cancelled") -> None:
        self.transition(RunStatus.CANCELLED, message=message)

    def mark_lost(self, message: str = "the worker went silent") -> None:
        self.transition(RunStatus.LOST, message=message)

    @property
    def is_external(self) -> bool:
        """It trains in the user's own script: nothing here may queue, place, re-send, resume or
        mark it lost for a silent worker (it has none)."""
        return self.origin == RunOrigin.EXTERNAL

    @property
    def status_badge(self) -> str:
        return RunStatus(self.status).badge

    @property
    def team(self) -> Team:
        return self.project.team


class MetricPoint(models.Model):
    """One value of a metrics event; ``seq`` is the event's, so the live socket can replay it."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metric_points")
    name = models.CharField(max_length=200)
    step = models.IntegerField()
    value = models.FloatField()
    time = models.DateTimeField()
    seq = models.BigIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that logged it.")
    superseded = models.BooleanField(
        default=False,
        help_text="A later attempt resumed from an earlier step and logged this step again: kept, not charted by default.",
    )

    class Meta:
        # One point per step and attempt: a rewound attempt logs a step again beside the point it
        # supersedes. The constraint's index (run, name, step, attempt) also serves a run's series
        # in step order.
        constraints = [
            models.UniqueConstraint(
                fields=["run", "name", "step", "attempt"], name="metric_one_per_run_name_step_attempt"
            )
        ]
        indexes = [
            models.Index(fields=["run", "seq"], name="metric_run_seq"),
            # Few points are superseded: a partial index finds them without reading the run's history.
            models.Index(
                fields=["run", "name", "step"], condition=models.Q(superseded=True), name="metric_superseded"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name}@{self.step}={self.value}"


def prompt_hash(prompt: str) -> str:
    """The MD5 hex digest of a prompt's UTF-8 text: ``Sample.prompt_hash``, which the indexes find a
    prompt's samples by (a prompt is free text of any length; a B-tree cannot index it whole on
    PostgreSQL, and equality on 32 characters is cheap on both databases). Not a security hash: a
    collision would only put a different prompt's samples beside it, and readers compare the text."""
    return hashlib.md5(prompt.encode("utf-8", "surrogatepass"), usedforsecurity=False).hexdigest()


class Sample(models.Model):
    """One rollout of a samples event; ``index`` is its position among the event's items.

    Text search is ``__search`` on prompt/completion (``webapp.runs.lookups``): ILIKE on
    PostgreSQL, which the trigram GIN indexes of migration 0002 serve (SQLite scans a run's samples).
    The same prompt's samples, in this run or another, are found by ``prompt_hash`` (set from
    ``prompt`` whenever a Sample is built with one or saved, so ``bulk_create`` at ingest fills it).
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="samples")
    step = models.IntegerField()
    seq = models.BigIntegerField()
    index = models.IntegerField(default=0)
    prompt = models.TextField()
    completion = models.TextField()
    reward = models.FloatField(null=True, blank=True)
    advantage = models.FloatField(null=True, blank=True)
    length = models.IntegerField(default=0)
    finish_reason = models.CharField(max_length=32, blank=True)
    extra = models.JSONField(default=dict, blank=True)
    attempt = models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that logged it.")
    superseded = models.BooleanField(default=False, help_text="A later attempt logged its step again.")
    prompt_hash = models.CharField(
        max_length=32, blank=True, default="", help_text="MD5 of the prompt text (runs.models.prompt_hash)."
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "seq", "index"], name="sample_one_per_run_seq_index")
        ]
        indexes = [
            models.Index(fields=["run", "step"], name="sample_run_step"),
            models.Index(fields=["run", "reward"], name="sample_run_reward"),
            models.Index(fields=["run", "length"], name="sample_run_length"),
            # A prompt's samples: in one run (follow, compare) and across a project's runs (compare's choice).
            models.Index(fields=["prompt_hash", "run", "step"], name="sample_prompt_run_step"),
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Keyword construction is how new rows are built (ingest, tests); rows read from the database
        # come positionally with their stored hash.
        if "prompt" in kwargs and not kwargs.get("prompt_hash"):
            kwargs["prompt_hash"] = prompt_hash(kwargs["prompt"])
        super().__init__(*args, **kwargs)

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.prompt_hash = prompt_hash(self.prompt)
        super().save(*args, **kwargs)

    def item(self) -> dict[str, Any]:
        """The rollout as an item of the event protocol's ``samples`` event."""
        return {
            "prompt": self.prompt,
            "completion": self.completion,
            "reward": self.reward,
            "advantage": self.advantage,
            "length": self.length,
            "finish_reason": self.finish_reason,
            "extra": self.extra,
        }


class Checkpoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    seq = models.BigIntegerField()
    step = models.IntegerField()
    path = models.TextField()
    bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    attempt = models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that wrote it.")
    superseded = models.BooleanField(
        default=False,
        help_text="A later attempt resumed from an earlier step: this checkpoint is off the run's history "
        "(its files may be overwritten by the new branch's checkpoint of the same step), so it is not offered.",
    )
    deleted_at_seq = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The seq of the checkpoint event whose save deleted its files (checkpoint.keep_last keeps the "
        "newest few; a rewind removes the branch it left): listed, not offered. Null while its files are there.",
    )

    @property
    def deleted(self) -> bool:
        return self.deleted_at_seq is not None

    @staticmethod
    def offered(via: str = "") -> models.Q:
        """The checkpoints a resume may start from: on the run's history and with their files still
        there. ``via`` is the lookup path from the queried model (``"checkpoints__"`` from a run)."""
        return models.Q(**{f"{via}superseded": False, f"{via}deleted_at_seq__isnull": True})

    class Meta:
        ordering = ["step", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="checkpoint_one_per_run_seq")]


class RunAttempt(models.Model):
    """One time the run was queued and ran: its launch (number 1), then each resume.

    A resume continues the same run (one URL, one history); this row says when the attempt
    was queued, started and ended, on which worker, from which checkpoint, how it ended and
    which seqs its engine wrote. ``first_step`` is the step of its first metrics or samples
    event: the earlier attempts' records at that step and later are superseded
    (``webapp.runs.ingest``), as W&B's rewind does. Run.attempt (the ingest token's counter) moves
    on at every queue message, a reconciler's re-send included; this number moves only when a
    user launches or resumes."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    queued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    worker_host = models.CharField(max_length=255, blank=True)
    from_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="resumed_attempts"
    )
    from_step = models.IntegerField(
        null=True, blank=True, help_text="The step of the checkpoint it resumed from (None: from the start)."
    )
    first_step = models.IntegerField(
        null=True, blank=True, help_text="The step of its first metrics or samples event (None: none yet)."
    )
    status = models.CharField(
        max_length=16, choices=RunStatus.choices, blank=True, help_text="How it ended (blank while it runs)."
    )
    message = models.TextField(blank=True)
    first_seq = models.BigIntegerField(null=True, blank=True)
    last_seq = models.BigIntegerField(null=True, blank=True)
    engine_from_seq = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The last seq in the run's event log when this attempt's supervisor attached: events "
        "at or below it that arrive now are an earlier engine's unshipped tail (webapp.runs.ingest).",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["run", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="attempt_one_per_run_number")]

    def __str__(self) -> str:
        return f"attempt {self.number} of run {self.run_id}"


class LogLine(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="log_lines")
    seq = models.BigIntegerField()
    level = models.CharField(max_length=16, choices=LogLevel.choices, default=LogLevel.INFO)
    message = models.TextField()
    time = models.DateTimeField()

    class Meta:
        ordering = ["seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="logline_one_per_run_seq")]


class OutputLine(models.Model):
    """One line of the engine's output (stderr of every rank, native libraries, progress), for the
    Logs tab; ``offset`` is where it starts in the run's stored full log. Only the newest
    ``webapp.runs.output.OUTPUT_LINES_KEPT`` of a run are kept; the full log has every line."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="output_lines")
    offset = models.BigIntegerField()
    level = models.CharField(max_length=16, choices=LogLevel.choices, default=LogLevel.INFO)
    message = models.TextField()
    time = models.DateTimeField()

    class Meta:
        ordering = ["offset"]
        constraints = [
            models.UniqueConstraint(fields=["run", "offset"], name="outputline_one_per_run_offset")
        ]


class ShareLink(models.Model):
    """A read-only link to one run: whoever holds the token sees the run page and its rollouts,
    nothing else. Revoking (``webapp.runs.sharing``) keeps the row (who shared what, when) and
    stops the token working."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="share_links")
    token = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"share link of run {self.run_id}"

    def get_absolute_url(self) -> str:
        """The run's page, read-only, for whoever holds the token."""
        return reverse("share", kwargs={"token": self.token})

    @classmethod
    def create(cls, run: Run, user: object) -> ShareLink:
        return cls.objects.create(run=run, token=secrets.token_urlsafe(24), created_by=user)

    @classmethod
    def run_for_token(cls, token: str) -> Run | None:
        """The run a live (not revoked) token opens, else None."""
        if not token:
            return None
        link = cls.objects.select_related("run__project__team").filter(token=token, revoked_at=None).first()
        return link.run if link else None
