"""Run statuses (with their badge colour and legal transitions) and parent kinds, in one place.

The status names are the run states of ``engine.contracts``, which the engine, the worker and
the pages share; here they gain labels, badge colours and the state machine.
"""

from __future__ import annotations

from django.db import models

from engine.contracts import ACTIVE_STATES, FINAL_STATES, RUN_STATES


class RunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Lost"

    @property
    def badge(self) -> str:
        """Bootstrap-style colour name for the status badge."""
        return _BADGE[self]

    @property
    def is_final(self) -> bool:
        """No worker is running it; only a resume queues it again (a new ``RunAttempt``)."""
        return self in FINAL_STATUSES

    def can_become(self, to: RunStatus | str) -> bool:
        return RunStatus(to) in TRANSITIONS[self]


_BADGE = {
    RunStatus.QUEUED: "secondary",
    RunStatus.STARTING: "info",
    RunStatus.RUNNING: "primary",
    RunStatus.SUCCEEDED: "success",
    RunStatus.FAILED: "danger",
    RunStatus.CANCELLED: "dark",
    RunStatus.LOST: "warning",
}

# The state machine. Everything not listed here is refused (``InvalidTransition``).
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.STARTING, RunStatus.CANCELLED}),
    RunStatus.STARTING: frozenset({RunStatus.RUNNING, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.LOST}),
    RunStatus.RUNNING: frozenset(
        {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.LOST}
    ),
    # Final: nothing the engine or a worker says moves the run on. Only a user's resume
    # (``webapp.runs.services.resume_run``) queues it again, as a new attempt of the same run
    # (``RunAttempt``) from one of its checkpoints, on any worker: one mechanism for all four.
    RunStatus.SUCCEEDED: frozenset({RunStatus.QUEUED}),
    RunStatus.FAILED: frozenset({RunStatus.QUEUED}),
    RunStatus.CANCELLED: frozenset({RunStatus.QUEUED}),
    RunStatus.LOST: frozenset({RunStatus.QUEUED}),
}

FINAL_STATUSES = frozenset(RunStatus(state) for state in FINAL_STATES)
ACTIVE_STATUSES = frozenset(RunStatus(state) for state in ACTIVE_STATES)
if set(RunStatus.values) != set(RUN_STATES):  # a state added on one side only: fail at import, not later
    raise RuntimeError(f"RunStatus {sorted(RunStatus.values)} differs from engine.contracts.RUN_STATES")


class RunOrigin(models.TextChoices):
    """Where a run trains. An engine run is queued to a worker, which starts Tributary's engine;
    an external run trains in the user's own script (the client library, verl's files, TRL's
    callback), which creates it through the API and ships its events itself: no queue, no worker."""

    ENGINE = "engine", "Engine"
    EXTERNAL = "external", "External"


class ParentKind(models.TextChoices):
    FORK = "fork", "Fork"  # a new run from the parent's config with changes
    # Runs made before a resume continued the same run: a child that continued its parent from one
    # of its checkpoints. Kept so those runs still show their lineage; no new run gets it.
    RESUME = "resume", "Resume"


class LogLevel(models.TextChoices):
    DEBUG = "debug", "Debug"
    INFO = "info", "Info"
    WARNING = "warning", "Warning"
    ERROR = "error", "Error"
