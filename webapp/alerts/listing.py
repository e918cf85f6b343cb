"""Alerts as the pages show them: each with its rule's title."""

from __future__ import annotations

from typing import Any

from django.db.models import Count

from webapp.alerts.models import Alert
from webapp.alerts.rules import RULES

TITLES = {name: rule.title for name, rule in RULES.items()}


def for_run(run_id: int) -> list[dict[str, Any]]:
    """The run's alerts, oldest step first, for the run page (rendered, and as its scripts' JSON)."""
    return [
        {**a.item(), "title": TITLES.get(a.rule, a.rule), "created_at": a.created_at}
        for a in Alert.objects.filter(run_id=run_id).order_by("step", "id")
    ]


def counts_for(run_ids: list[int]) -> dict[int, int]:
    """How many alerts each run raised: one query for a page of the runs table."""
    rows = Alert.objects.filter(run_id__in=run_ids).values("run_id").annotate(n=Count("id")).order_by()
    return {row["run_id"]: row["n"] for row in rows}
