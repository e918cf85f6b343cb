"""Sending a run to its queue: the ``jobs.supervise_run`` task, with a fresh ingest token and
whether the run may execute its own reward code.

Everything the message carries comes from the run's row, so both a launch
(``webapp.runs.services``) and the reconciler (``webapp.runs.reconcile``, when the broker lost a
message) send it through ``queue_run``.
"""

from __future__ import annotations

from typing import Any

from engine.rewards.policy import RewardPolicy
from jobs.app import SUPERVISE_TASK, app
from jobs.registry import WorkerEntry
from webapp.runs import placement
from webapp.runs.models import Run
from webapp.runs.tokens import start_attempt
from webapp.teams.choices import Role
from webapp.teams.models import Project


def reward_policy_for(project: Project, user: Any) -> RewardPolicy:
    """Which reward functions ``user`` may name in ``project``'s runs (``engine/rewards/policy.py``).

    The built-ins and the deployment's reward modules (``TRIBUTARY_REWARD_MODULES``) for everyone;
    any ``module:function`` only for the admins of a team a site administrator trusts with it
    (``Team.allow_user_code``, set in Django's admin)."""
    team = project.team
    trusted = team.allow_user_code and team.allows(user, Role.ADMIN)
    return RewardPolicy.of_deployment(allow_any=trusted)


def runs_own_code(config: dict[str, Any]) -> bool:
    """Whether a validated config names a reward outside the registry and the deployment's modules,
    in ``reward.functions`` or in a stage's own ``reward_functions`` (``data.stages``)."""
    lists = [(config.get("reward") or {}).get("functions")]
    lists += [stage.get("reward_functions") for stage in (config.get("data") or {}).get("stages") or []]
    names = [f.get("name", "") for functions in lists for f in functions or []]
    return RewardPolicy.of_deployment(allow_any=False).names_own_code(names)


def queue_run(run: Run, *, workers: list[WorkerEntry] | None = None) -> None:
    """Send the supervisor task for ``run`` to its queue, with a fresh ingest token; its status says
    why it waits when no online worker (``workers``, read from the registry if not given) can take it.

    Everything the message carries comes from the run's row, so the reconciler
    (``webapp.runs.reconcile``) can send it again when the broker lost it."""
    app.send_task(
        SUPERVISE_TASK,
        kwargs={
            "run_id": run.pk,
            "config": run.config,
            "token": start_attempt(run.pk),  # a new attempt: older tokens die
            "start_seq": run.last_seq,
            # Decided again at every send: an admin demoted since, or a team no longer trusted,
            # and the worker's engine refuses the run's own code (a clear bad-config failure).
            "user_code": runs_own_code(run.config)
            and reward_policy_for(run.project, run.created_by).allow_any,
            # A resume's: the checkpoint directory (the engine takes the newest there) or the chosen one.
            "resume_path": run.resume_path or (run.resume_from.path if run.resume_from else None),
        },
        queue=run.queue,
    )
    placement.refresh_waiting(run, placement.live_workers() if workers is None else workers)
