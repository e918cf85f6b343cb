"""Evaluating the health rules at ingest, inside the batch's transaction.

``observe`` runs in ``webapp.runs.ingest._store`` under the run's row lock, so the rules' state
(``Run.alert_state``) moves with the cursor: a batch rolled back leaves no alert and no
state behind, and a batch sent again is skipped before it reaches the rules. What fired is
announced, and sent to the project's webhook, once the batch commits.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from django.db import transaction
from django.db.models import OuterRef, QuerySet, Subquery

from engine.config.async_rl import AsyncConfig
from engine.config.model_data import DataConfig
from webapp.alerts import webhooks
from webapp.alerts.models import Alert, ProjectAlertSettings
from webapp.alerts.rules import Observation, effective, evaluate
from webapp.live import announce
from webapp.runs.models import Run

FACTS = {
    # what the rules read of the run's config: (section, field) and the engine's default
    "max_staleness": ("async", "max_staleness", AsyncConfig.model_fields["max_staleness"].default),
    "eval_size": ("data", "eval_size", DataConfig.model_fields["eval_size"].default),
}


def run_facts(run: Run) -> dict[str, Any]:
    """What rules read of the run's config (the staleness bound, the eval set's size); the
    engine's default where the stored config leaves a field out."""
    out: dict[str, Any] = {}
    for name, (section, field, default) in FACTS.items():
        part = run.config.get(section) if isinstance(run.config, Mapping) else None
        value = part.get(field) if isinstance(part, Mapping) else None
        out[name] = value if isinstance(value, int) and not isinstance(value, bool) else default
    return out


def with_project_settings(runs: QuerySet[Run]) -> QuerySet[Run]:
    """``runs`` with their project's alert settings read in the same query (``alert_rules``,
    ``alert_webhook``): ingest locks the run with this, so the rules add no query per batch."""
    settings = ProjectAlertSettings.objects.filter(project_id=OuterRef("project_id"))
    return runs.annotate(
        alert_rules=Subquery(settings.values("rules")[:1]),
        alert_webhook=Subquery(settings.values("webhook_url")[:1]),
    )


def observe(run: Run, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Feed a batch's stored metrics events to the rules; store and (after commit) announce what
    fired; return the rules' new state.

    The state is ``run.alert_state``, left untouched: the caller (ingest) writes the new one with
    the batch's cursor in the same UPDATE, so a batch that fails and is retried event by event
    starts again from the stored state. ``run`` is read through ``with_project_settings``: the
    project's settings come with it."""
    observations = [
        Observation(e["step"], e["seq"], e["values"], tuple(e.get("non_finite", ())))
        for e in events
        if e["type"] == "metrics" and not e.get("quarantined")
    ]
    if not observations:
        return run.alert_state
    params = effective(run.alert_rules or {}, run.alert_overrides or {})
    state = copy.deepcopy(run.alert_state)
    fired = evaluate(state, observations, params, run_facts(run))
    if not fired:
        return state
    Alert.objects.bulk_create(
        [
            Alert(
                run_id=run.pk,
                rule=f.rule,
                step=f.step,
                seq=f.seq,
                metric=f.metric,
                value=f.value,
                threshold=f.threshold,
                message=f.message,
            )
            for f in fired
        ],
        ignore_conflicts=True,
    )
    stored = list(Alert.objects.filter(run_id=run.pk, seq__in=[f.seq for f in fired]).order_by("step", "id"))
    items = [a.item() for a in stored]
    announce.alerts_fired(run.pk, run.project_id, items)
    webhook = run.alert_webhook or ""
    if webhook:
        payload = webhooks.payload(run, items)
        transaction.on_commit(lambda: webhooks.post_later(webhook, payload))
    return state
