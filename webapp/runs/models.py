from __future__ import annotations

import secrets
from typing import Any

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from webapp.runs.choices import FINAL_STATUSES, TRANSITIONS, LogLevel, ParentKind, RunStatus
from webapp.teams.models import Project, Team


class InvalidTransition(Exception):
    """A run status change the state machine refuses; nothing was written."""

    def __init__(self, run_id: int | None, current: str, requested: str, reason: str = "") -> None:
        self.run_id, self.current, self.requested = run_id, str(current), str(requested)
        if not reason:
            allowed = sorted(s.value for s in TRANSITIONS[RunStatus(current)])
            reason = (
                f"from {self.current!r} it can go to {', '.join(allowed)}"
                if allowed
                else f"{self.current!r} is final"
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
        default=dict, help_text="The engine RunConfig, validated by the engine's schema."
    )
    tags = models.JSONField(default=list, blank=True)
    notes = models.TextField(blank=True)

    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    status_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
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

    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    parent_kind = models.CharField(max_length=16, choices=ParentKind.choices, blank=True)

    last_step = models.IntegerField(default=0)
    summary = models.JSONField(default=dict, blank=True, help_text="Last value of each metric.")
    last_seq = models.BigIntegerField(default=0, help_text="Ingest cursor: highest event seq stored.")
    resume_from = models.ForeignKey(
        "Checkpoint",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="resumed_by",
        help_text="The parent's checkpoint this run starts from (a resume).",
    )
    resume_path = models.TextField(
        blank=True,
        help_text="Where the engine resumes from when not resume_from's own path (e.g. the parent's "
        "checkpoint directory: the newest there); kept so a queue message can be sent again.",
    )
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="A user asked to cancel; the worker is told on its socket."
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
        ]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    def get_absolute_url(self) -> str:
        return reverse("run", kwargs={"run_id": self.pk})

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

    def start(self, worker_host: str) -> None:
        """A worker claims the queued run; only one of several competing workers wins."""
        self.transition(RunStatus.STARTING, worker_host=worker_host)

    def cancel(self, message: str = "cancelled") -> None:
        self.transition(RunStatus.CANCELLED, message=message)

    def mark_lost(self, message: str = "the worker went silent") -> None:
        self.transition(RunStatus.LOST, message=message)

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

    class Meta:
        # The unique constraint's index (run, name, step) also serves a run's series in step order.
        constraints = [
            models.UniqueConstraint(fields=["run", "name", "step"], name="metric_one_per_run_name_step")
        ]
        indexes = [models.Index(fields=["run", "seq"], name="metric_run_seq")]

    def __str__(self) -> str:
        return f"{self.name}@{self.step}={self.value}"


class Sample(models.Model):
    """One rollout of a samples event; ``index`` is its position among the event's items.

    Text search is ``icontains`` on prompt/completion; on PostgreSQL migration 0002 adds
    trigram GIN indexes that serve those ILIKE queries (SQLite scans a run's samples).
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

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "seq", "index"], name="sample_one_per_run_seq_index")
        ]
        indexes = [
            models.Index(fields=["run", "step"], name="sample_run_step"),
            models.Index(fields=["run", "reward"], name="sample_run_reward"),
            models.Index(fields=["run", "length"], name="sample_run_length"),
        ]

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

    class Meta:
        ordering = ["step", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="checkpoint_one_per_run_seq")]


class LogLine(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="log_lines")
    seq = models.BigIntegerField()
    level = models.CharField(max_length=16, choices=LogLevel.choices, default=LogLevel.INFO)
    message = models.TextField()
    time = models.DateTimeField()

    class Meta:
        ordering = ["seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="logline_one_per_run_seq")]


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
