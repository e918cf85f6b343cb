"""Sparklines for the runs table: one downsampled series per run, for a whole page of runs at once.

``webapp.runs.selectors.metric_series`` downsamples one run's series (a few queries per run).
The runs table shows up to 50 runs, so here the same idea (buckets of equal step width, the
mean value of each) is done for all of the page's runs at once, in three queries whatever the
page's size:

- the step range of each run's series, from its coarsest blocks (``webapp.analysis.rollups``);
- a long series (``rollups.WIDTHS[0]`` steps a bucket or more) is combined from its blocks, as
  ``metric_series`` does: buckets ``step // w`` for the smallest power of two ``w`` that gives at
  most ``points`` of them, each from the widest stored blocks that fit (at most ``RATIO`` rows a
  bucket). A page of 50 runs of 10,000 steps so reads about 2,000 block rows, not 500,000 points;
- a short series, or one without blocks (points written past ingest), from its points: buckets of
  equal width over its own step range, from window aggregates over them.

The SVG is built from numbers only, so it is safe to put in the page as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import reduce
from operator import or_

from django.db import connection
from django.db.models import Max, Min, Q
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from webapp.analysis import rollups
from webapp.analysis.models import MetricRollup
from webapp.runs.models import MetricPoint
from webapp.runs.selectors import step_bucket_width

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
    out = _from_blocks(ids, name, points)
    rest = [run_id for run_id in ids if run_id not in out]
    if rest:
        out.update(_from_points(rest, name, points))
    return {run_id: out[run_id] for run_id in ids if out.get(run_id)}


def _from_blocks(ids: list[int], name: str, points: int) -> dict[int, list[tuple[int, float]]]:
    """The series of the runs whose buckets are wide enough to be combined from blocks."""
    ranges = (
        MetricRollup.objects.filter(run_id__in=ids, name=name, width=rollups.WIDTHS[-1])
        .values("run_id")
        .annotate(lo=Min("first_step"), hi=Max("last_step"))
        .order_by()
        .values_list("run_id", "lo", "hi")
    )
    plan: dict[int, tuple[int, int]] = {}  # run -> (stored width, bucket width)
    for run_id, lo, hi in ranges:
        bucket = step_bucket_width(lo - 1, hi + 1, points)  # buckets s // w of the steps lo..hi
        fitting = [w for w in rollups.WIDTHS if w <= bucket]
        if fitting:
            plan[run_id] = (fitting[-1], bucket)
    if not plan:
        return {}
    by_width: dict[int, list[int]] = {}
    for run_id, (stored, _) in plan.items():
        by_width.setdefault(stored, []).append(run_id)
    blocks = (
        MetricRollup.objects.filter(name=name)
        .filter(reduce(or_, (Q(width=w, run_id__in=runs) for w, runs in by_width.items())))
        .order_by("run_id", "block")
        .values_list("run_id", "block", "count", "total", "first_step")
    )
    sums: dict[int, dict[int, list[float]]] = {}
    for run_id, block, count, total, first_step in blocks:
        stored, bucket = plan[run_id]
        acc = sums.setdefault(run_id, {}).setdefault(block * stored // bucket, [0, 0.0, first_step])
        acc[0] += count
        acc[1] += total
    out: dict[int, list[tuple[int, float]]] = {}
    for run_id, buckets in sums.items():
        series = [(int(s), n_total * rollups.SCALE / n) for n, n_total, s in buckets.values()]
        out[run_id] = [(s, v) for s, v in series if math.isfinite(v)]
    return out


def _from_points(ids: list[int], name: str, points: int) -> dict[int, list[tuple[int, float]]]:
    """The series of runs ``ids`` from their points (short ones, or without blocks)."""
    # The run's history as it stands: not the points a resume from an earlier step superseded.
    # bucket = (step - lo) * points // span, in [0, points - 1], with each run's own step range
    # from window aggregates over its points: integer division on both databases. One query,
    # read through the cursor: Django's converters cost more than the query for the page's
    # 2,000 buckets, and a ``CASE`` with a branch per run was as costly to build.
    table_name = connection.ops.quote_name(MetricPoint._meta.db_table)
    window = "OVER (PARTITION BY run_id)"
    sql = (
        # SUM / COUNT of the scaled values, as metric_series: PostgreSQL's AVG also sums the
        # squares, which overflow (an error) from values of 1e154 on.
        f"SELECT run_id, MIN(step), SUM{rollups.SCALED_VALUE} / COUNT(*) FROM ("
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
    for run_id, step, scaled in rows:
        value = None if scaled is None else float(scaled) * rollups.SCALE
        if value is None or not math.isfinite(value):
            continue
        out.setdefault(run_id, []).append((int(step), value))
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
