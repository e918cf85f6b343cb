"""Sparklines for the runs table: one downsampled series per run, for a whole page of runs at once.

``webapp.runs.selectors.metric_series`` downsamples one run's series (a few queries per run).
The runs table shows up to 50 runs, so here the same idea (buckets of equal step width, the
mean value of each) is done for all of the page's runs in one query: each run's step range from
window aggregates over its points, and its bucket means.
The SVG is built from numbers only, so it is safe to put in the page as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from django.db import connection
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from webapp.runs.models import MetricPoint

POINTS = 40
WIDTH = 96
HEIGHT = 24
PAD = 2


def series_for_runs(
    run_ids: Iterable[int], name: str, points: int = POINTS
) -> dict[int, list[tuple[int, float]]]:
    """``{run_id: [(step, value), ...]}`` in step order, at most ``points`` per run.

    A run with no point of ``name`` is left out. A bucket reports its first step and its mean.
    """
    ids = sorted(set(run_ids))
    if not ids:
        return {}
    # The run's history as it stands: not the points a resume from an earlier step superseded.
    # bucket = (step - lo) * points // span, in [0, points - 1], with each run's own step range
    # from window aggregates over its points: integer division on both databases. One query,
    # read through the cursor: Django's converters cost more than the query for the page's
    # 2,000 buckets, and a ``CASE`` with a branch per run was as costly to build.
    table_name = connection.ops.quote_name(MetricPoint._meta.db_table)
    window = "OVER (PARTITION BY run_id)"
    sql = (
        "SELECT run_id, MIN(step), AVG(value) FROM ("
        # BIGINT: (step - lo) * points overflows PostgreSQL's integer from step 2^31 / points on.
        f" SELECT run_id, step, value, CAST(step - MIN(step) {window} AS BIGINT) * %s"
        f" / (MAX(step) {window} - MIN(step) {window} + 1) AS bucket"
        f" FROM {table_name} WHERE run_id IN ({', '.join(['%s'] * len(ids))}) AND name = %s"
        " AND NOT superseded"
        ") AS p GROUP BY run_id, bucket ORDER BY run_id, 2"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [points, *ids, name])
        rows = cursor.fetchall()
    out: dict[int, list[tuple[int, float]]] = {}
    for run_id, step, value in rows:
        if value is None or not math.isfinite(value):
            continue
        out.setdefault(run_id, []).append((int(step), float(value)))
    return out


def svg(series: list[tuple[int, float]], label: str, width: int = WIDTH, height: int = HEIGHT) -> SafeString:
    """An inline SVG polyline of ``series`` (empty string when there is nothing to draw).

    ``label`` is escaped here; everything else in the markup is a number.
    """
    if not series:
        return mark_safe("")
    steps = [s for s, _ in series]
    values = [v for _, v in series]
    s_lo, s_hi = min(steps), max(steps)
    v_lo, v_hi = min(values), max(values)
    inner_w, inner_h = width - 2 * PAD, height - 2 * PAD

    def x(step: int) -> float:
        return PAD + (inner_w * (step - s_lo) / (s_hi - s_lo) if s_hi > s_lo else inner_w / 2)

    def y(value: float) -> float:
        return PAD + (inner_h * (1 - (value - v_lo) / (v_hi - v_lo)) if v_hi > v_lo else inner_h / 2)

    coords = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in series)
    last_x, last_y = x(steps[-1]), y(values[-1])
    return mark_safe(
        f'<svg class="sparkline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{escape(label)}" data-points="{len(series)}">'
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{coords}"/>'
        f'<circle cx="{last_x:.1f}" cy="{last_y:.1f}" r="2" fill="currentColor"/></svg>'
    )


def sparklines(run_ids: Iterable[int], name: str, points: int = POINTS) -> dict[int, SafeString]:
    """``{run_id: <svg>}`` for the runs that logged ``name``."""
    return {
        run_id: svg(series, f"{name} trend over {len(series)} points")
        for run_id, series in series_for_runs(run_ids, name, points).items()
    }
