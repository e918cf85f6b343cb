"""The compare page's server-side parts: which ids, the config diff, the summary table."""

from __future__ import annotations

import json
from typing import Any

from django.db.models import Max, Min

from webapp.runs import selectors
from webapp.runs.models import MetricPoint, Run

MAX_RUNS = 12
CANDIDATES = 200  # runs the "add runs" picker lists at most

# Metrics of the summary table: name and which way is better (None: final value only).
KEY_METRICS: list[tuple[str, str | None]] = [
    ("reward/mean", "max"),
    ("train/accuracy", "max"),
    ("eval/accuracy", "max"),
    ("actor/entropy", None),
    ("actor/kl_loss", "min"),
    ("response_length/mean", None),
    ("actor/grad_norm", None),
]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists and scalars are leaves (an empty dict is a leaf too)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


MISSING = object()


def _show(value: Any) -> str:
    if value is MISSING:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def config_diff(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per dotted key of any config: the value of each run (``—`` where absent) and
    whether they differ. Keys in first-seen order."""
    flat = [flatten(c or {}) for c in configs]
    keys: list[str] = []
    seen: set[str] = set()
    for f in flat:
        for key in f:
            if key not in seen:
                seen.add(key)
                keys.append(key)
    rows = []
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        canon = {json.dumps(v, sort_keys=True) if v is not MISSING else "\0missing" for v in values}
        rows.append({"key": key, "values": [_show(v) for v in values], "differs": len(canon) > 1})
    return rows


def candidates(user: Any, runs: list[Run], limit: int = CANDIDATES) -> list[Run]:
    """Runs the "add runs" picker offers: the newest of the shown runs' projects that are not
    shown yet, or, with nothing shown, the newest the user can see."""
    qs = selectors.runs_visible_to(user).exclude(pk__in=[r.pk for r in runs])
    if runs:
        qs = qs.filter(project__in={r.project_id for r in runs})
    return list(qs.select_related("project").order_by("-created_at", "-id")[:limit])


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per key metric that any run logged: per run the final value and the best one."""
    if not runs:
        return []
    finals = {r.pk: {m["name"]: m["last_value"] for m in selectors.metric_names(r)} for r in runs}
    names = [n for n, _ in KEY_METRICS]
    extremes = {
        (row["run_id"], row["name"]): row
        for row in MetricPoint.objects.filter(run__in=runs, name__in=names, superseded=False)
        .values("run_id", "name")
        .annotate(hi=Max("value"), lo=Min("value"))
        .order_by()
    }
    rows = []
    for name, better in KEY_METRICS:
        if not any(name in finals[r.pk] for r in runs):
            continue
        cells = []
        for r in runs:
            ext = extremes.get((r.pk, name))
            best = None
            if ext is not None and better is not None:
                best = ext["hi"] if better == "max" else ext["lo"]
            cells.append({"final": finals[r.pk].get(name), "best": best})
        rows.append({"name": name, "better": better, "cells": cells})
    return rows
