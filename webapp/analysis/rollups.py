"""Keeping ``MetricRollup`` rows at ingest: each metric's points pre-aggregated in blocks of steps.

Why: a chart asks for a series downsampled to about ``max_points`` buckets, and aggregating the
raw points reads every one of them (a compare page of 8 runs x 30 metrics x 10,000 steps read
2.4 million points per load). The blocks are the nodes of a fixed-width hierarchy (a B-tree-like
summary tree; the same idea as the aggregate pyramids of time-series databases, e.g. the
continuous aggregates of TimescaleDB or RRDtool's archives): a block of width ``w`` holds the
points with ``block * w <= step < (block + 1) * w`` and their count, sum, min, max, first and last
step and earliest time. These are all *decomposable* aggregates (a block of width ``8w`` is the
combination of its eight blocks of width ``w``), so a bucket of any power-of-two width ``W >= w``
aligned on multiples of ``W`` is the combination of ``W / w`` stored blocks, exactly.
``webapp.runs.selectors.metric_series`` reads the widest stored width that fits in its bucket
width: at most ``RATIO`` rows per bucket, whatever the series' length.

The rows hold exactly the points the points table holds, not superseded, as long as every point
is stored by ``webapp.runs.ingest.store_events`` (imports too); points written past it (a bench's
direct inserts) need ``rebuild``, and a metric without any block is read from its points:

- ``record`` runs after ingest stored a batch, in its transaction: one statement aggregates the
  points stored with the batch's seqs (all above the run's cursor, so no earlier batch's; a point
  the database ignored, a metric logged again at a stored step, keeps the seq of the batch that
  stored it first, so it is not counted twice), finest width from the points and the coarser ones from that, and merges them into the stored
  blocks (``INSERT ... ON CONFLICT DO UPDATE``: counts and sums add, min/max combine).
- ``rewind`` runs when a resume superseded points from step ``s`` on (``ingest._supersede``): the
  blocks that reach ``s`` are deleted and rebuilt from the points still in the history, the
  finest width from the points (at most ``WIDTHS[0]`` a metric) and each coarser width from the
  one below (at most ``RATIO`` rows a block).
- ``rebuild`` is the same from step 0: the migration's backfill of runs stored before the table.

A mean is ``total / count * SCALE``, which rounds differently from the database's ``AVG`` over
the points (another summation order): equal to about 1e-15 relative, not bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from django.db import connection

WIDTHS = (16, 128, 1024, 8192, 65536, 524288)
"""Block widths in steps: powers of two, each ``RATIO`` times the one before. The finest sets
where rollups start to pay (a series of fewer than 16 steps a bucket is read as points: at most
16 x max_points of them); the coarsest keeps a series of 2^31 steps at about 4,000 rows."""
RATIO = 8

SCALE = 2**40
"""The sums are kept divided by 2^40, ``total / count * SCALE`` is the mean: a power of two scales
a binary float exactly (the same mean, bit for bit, as an unscaled sum in the same order), and a
sum of up to 2^40 values of any finite size stays finite, so no value ingest takes (up to
1.8e308) can make the upsert overflow (PostgreSQL raises then, and ingest would quarantine the
batch). The price: a value under 2.4e-296 in magnitude loses precision in the mean (subnormal).
The points' own means are read the same way (``selectors``), so both agree."""
TINY = 1e-290
"""A value under this in magnitude counts as 0 in the sums: divided by ``SCALE`` it would come out
at or near 0, and PostgreSQL refuses a nonzero quotient that underflows to 0 ("value out of range:
underflow"), which quarantined the whole batch holding a value under 5.4e-312 (a subnormal, such
as 5e-324, is a legal finite value). A mean loses at most ``TINY`` per such value, below the
precision it had already lost there; min and max keep the values exactly."""
SCALED_VALUE = (  # value / SCALE, literals every parser reads exactly
    "(CASE WHEN ABS(value) < 1e-290 THEN 0.0 ELSE value / 1099511627776.0 END)"
)

POINTS = "runs_metricpoint"
ROLLUPS = "analysis_metricrollup"
COLUMNS = "run_id, name, width, block, count, total, min, max, first_step, last_step, first_time"
_COMBINED = (
    "SUM(count) AS count, SUM(total) AS total, MIN(min) AS min, MAX(max) AS max, "
    "MIN(first_step) AS first_step, MAX(last_step) AS last_step, MIN(first_time) AS first_time"
)
_FROM_POINTS = (
    f"COUNT(*) AS count, SUM{SCALED_VALUE} AS total, MIN(value) AS min, MAX(value) AS max, "
    "MIN(step) AS first_step, MAX(step) AS last_step, MIN(time) AS first_time"
)
_FIELDS = "count, total, min, max, first_step, last_step, first_time"


def _merge(vendor: str) -> str:
    """The upsert's conflict clause: a block stored already takes in the new one's points."""
    least, greatest = ("LEAST", "GREATEST") if vendor == "postgresql" else ("MIN", "MAX")
    return (
        "ON CONFLICT (run_id, name, width, block) DO UPDATE SET count = r.count + excluded.count, "
        f"total = r.total + excluded.total, min = {least}(r.min, excluded.min), "
        f"max = {greatest}(r.max, excluded.max), first_step = {least}(r.first_step, excluded.first_step), "
        f"last_step = {greatest}(r.last_step, excluded.last_step), "
        f"first_time = {least}(r.first_time, excluded.first_time)"
    )


def record(run_id: int, points: Sequence[Sequence[Any]]) -> None:
    """Fold the points ingest just stored for run ``run_id`` (``bulk.PointRow``s, seq 6th) into
    the rollups: one statement, whatever the batch's size. The points are read back by the
    batch's seqs (index (run, seq)): exactly the rows the database kept."""
    if not points:
        return
    seqs = [p[5] for p in points]
    w0 = WIDTHS[0]
    coarser = " UNION ALL ".join(
        f"SELECT name, {w} AS width, block / {w // w0} AS block, {_COMBINED} FROM fine "
        f"GROUP BY name, block / {w // w0}"
        for w in WIDTHS[1:]
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH fine AS (SELECT name, step / {w0} AS block, {_FROM_POINTS} FROM {POINTS} "
            "WHERE run_id = %s AND seq >= %s AND seq <= %s AND NOT superseded "
            f"GROUP BY name, step / {w0}) "
            f"INSERT INTO {ROLLUPS} AS r ({COLUMNS}) SELECT %s, name, width, block, {_FIELDS} FROM ("
            f"SELECT name, {w0} AS width, block, {_FIELDS} FROM fine UNION ALL {coarser}) AS blocks "
            f"WHERE true {_merge(connection.vendor)}",
            [run_id, min(seqs), max(seqs), run_id],
        )


def rewind(run_id: int, step: int) -> None:
    """Rebuild run ``run_id``'s blocks that reach ``step`` or later from its points not superseded
    (after a resume superseded the points from ``step`` on): ``len(WIDTHS) + 1`` statements that
    read at most ``WIDTHS[0]`` points and ``RATIO`` rows a block rebuilt."""
    with connection.cursor() as cursor:
        # The names first: the index (run, name, step) then finds each one's points from ``step``.
        cursor.execute(f"SELECT name FROM {ROLLUPS} WHERE run_id = %s AND width = {WIDTHS[-1]}", [run_id])
        names = sorted({row[0] for row in cursor.fetchall()})
        if not names:
            return
        cursor.execute(f"DELETE FROM {ROLLUPS} WHERE run_id = %s AND block >= %s / width", [run_id, step])
        _build(cursor, run_id, step, names)


def rebuild(run_id: int, using: Any = None) -> None:
    """Every block of run ``run_id`` from its points not superseded (the backfill: a run stored
    before this table, or points written past ingest). ``using``: a connection (a migration's)."""
    with (using or connection).cursor() as cursor:
        cursor.execute(f"DELETE FROM {ROLLUPS} WHERE run_id = %s", [run_id])
        _build(cursor, run_id, 0, None)


def _build(cursor: Any, run_id: int, step: int, names: list[str] | None) -> None:
    """Insert the blocks that hold ``step`` or later (deleted before), finest first, each coarser
    width from the one below it; ``names``: the metrics to read points of (None: all)."""
    w0 = WIDTHS[0]
    named = f"AND name IN ({', '.join(['%s'] * len(names))}) " if names else ""
    cursor.execute(
        f"INSERT INTO {ROLLUPS} ({COLUMNS}) SELECT %s, name, {w0}, step / {w0}, {_FROM_POINTS} "
        f"FROM {POINTS} WHERE run_id = %s {named}AND step >= %s AND NOT superseded GROUP BY name, step / {w0}",
        [run_id, run_id, *(names or []), step // w0 * w0],
    )
    for finer, width in itertools.pairwise(WIDTHS):
        ratio = width // finer
        cursor.execute(
            f"INSERT INTO {ROLLUPS} ({COLUMNS}) SELECT %s, name, {width}, block / {ratio}, {_COMBINED} "
            f"FROM {ROLLUPS} WHERE run_id = %s AND width = {finer} AND block >= %s "
            f"GROUP BY name, block / {ratio}",
            [run_id, run_id, step // width * ratio],
        )
