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

- ``record`` runs after ingest stored a batch, in its transaction, and merges the batch's blocks
  into the stored ones (``INSERT ... ON CONFLICT DO UPDATE``: counts and sums add, min/max
  combine): one statement, whatever the batch's size. When the database took every point of the
  batch (the usual case: ``bulk.insert_point_groups`` says so), the blocks are aggregated here from
  the points ingest holds, in one pass over the batch's events, and sent as the statement's
  parameters (``_blocks``). Otherwise some point was ignored (a metric logged again at a stored
  step keeps the seq of the batch that stored it first, and is not counted twice): the statement
  aggregates the points stored with the batch's seqs (all above the run's cursor, so no earlier
  batch's), finest width from the points and the coarser ones from that. Reading the points back
  (a sort of a batch's 25,000 points by name and block) was about half of that statement's time,
  and the statement the largest cost of a batch after the COPY and its commit (issue 19).
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
from typing import TYPE_CHECKING, Any

from django.db import connection

if TYPE_CHECKING:
    from webapp.runs.bulk import PointGroup

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


def record(run_id: int, groups: Sequence[PointGroup], *, all_stored: bool = False, data: Any = None) -> None:
    """Fold the points ingest just stored for run ``run_id`` (its metrics events as
    ``bulk.PointGroup``s) into the rollups: one statement, whatever the batch's size.

    ``all_stored``: the database took every point of ``groups`` (``bulk.insert_point_groups``), so
    they are exactly the rows stored with the batch's seqs and are aggregated here. Otherwise the
    points are read back by the batch's seqs (index (run, seq)): exactly the rows the database kept.
    ``data``: ``upsert_data(groups)``, when the caller built it before (ingest's ``Prepared``)."""
    groups = [group for group in groups if group.values]
    if not groups:
        return
    if all_stored:
        _upsert(run_id, upsert_data(groups) if data is None else data)
        return
    seqs = [group.seq for group in groups]
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


Block = list[Any]  # [count, total, min, max, first_step, last_step, first_time]


def _blocks(groups: Sequence[PointGroup]) -> dict[tuple[int, int], dict[str, Block]]:
    """The blocks of every width that the points of ``groups`` fall in: {(width, block): {name:
    [count, total, min, max, first_step, last_step, first_time]}}, the same aggregates the SQL of
    ``_FROM_POINTS`` and ``_COMBINED`` computes (the sum of ``SCALED_VALUE``s, in another order).

    The finest blocks from the points, one pass: an event's points share a step, hence a block,
    so the block's table is looked up once an event and each point costs one lookup by name. The
    coarser widths from the finer ones (at most a few thousand a batch)."""
    w0 = WIDTHS[0]
    scale, tiny = float(SCALE), TINY
    fine: dict[int, dict[str, Block]] = {}
    for _run, step, time, _seq, _attempt, values in groups:
        block = fine.get(step // w0)
        if block is None:
            block = fine[step // w0] = {}
        get = block.get
        for name, value in values.items():
            scaled = 0.0 if -tiny < value < tiny else value / scale
            row = get(name)
            if row is None:
                block[name] = [1, scaled, value, value, step, step, time]
                continue
            row[0] += 1
            row[1] += scaled
            if value < row[2]:
                row[2] = value
            if value > row[3]:
                row[3] = value
            if step < row[4]:
                row[4] = step
            if step > row[5]:
                row[5] = step
            if time < row[6]:
                row[6] = time
    out: dict[tuple[int, int], dict[str, Block]] = {(w0, b): names for b, names in fine.items()}
    finer = fine
    for low, width in itertools.pairwise(WIDTHS):
        ratio = width // low
        coarse: dict[int, dict[str, Block]] = {}
        for b, names in finer.items():
            into = coarse.setdefault(b // ratio, {})
            for name, (count, total, lo, hi, first, last, at) in names.items():
                row = into.get(name)
                if row is None:
                    into[name] = [count, total, lo, hi, first, last, at]
                    continue
                row[0] += count
                row[1] += total
                row[2] = min(row[2], lo)
                row[3] = max(row[3], hi)
                row[4] = min(row[4], first)
                row[5] = max(row[5], last)
                row[6] = min(row[6], at)
        out.update({(width, b): names for b, names in coarse.items()})
        finer = coarse
    return out


MAX_ROWS_PER_STATEMENT = 1000  # 11 parameters a row on SQLite: well under its 32,766


def upsert_data(groups: Sequence[PointGroup]) -> Any:
    """The blocks of ``groups`` (``_blocks``) as ``_upsert`` sends them: one array text a column on
    PostgreSQL (``_array_literals``), the rows on SQLite. Pure Python, reading no database: ingest
    builds it before it takes the run's row lock, beside the batch before in the database (issue 19)."""
    blocks = _blocks([group for group in groups if group.values])
    rows = [(name, width, b, *row) for (width, b), names in blocks.items() for name, row in names.items()]
    return _array_literals(rows) if connection.vendor == "postgresql" else rows


def _upsert(run_id: int, data: Any) -> None:
    """Merge the blocks ``upsert_data`` made into run ``run_id``'s stored ones (``_merge``): one
    statement on PostgreSQL, one per ``MAX_ROWS_PER_STATEMENT`` rows on SQLite."""
    merge = _merge(connection.vendor)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                f"INSERT INTO {ROLLUPS} AS r ({COLUMNS}) SELECT %s, * FROM unnest(%s::varchar[], %s::integer[], "
                "%s::integer[], %s::integer[], %s::double precision[], %s::double precision[], "
                f"%s::double precision[], %s::integer[], %s::integer[], %s::timestamptz[]) {merge}",
                [run_id, *data],
            )
            return
        adapt = connection.ops.adapt_datetimefield_value
        for start in range(0, len(data), MAX_ROWS_PER_STATEMENT):
            chunk = data[start : start + MAX_ROWS_PER_STATEMENT]
            placeholders = ", ".join(["(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"] * len(chunk))
            cursor.execute(
                f"INSERT INTO {ROLLUPS} AS r ({COLUMNS}) VALUES {placeholders} {merge}",
                [value for row in chunk for value in (run_id, *row[:9], adapt(row[9]))],
            )


def _array_literals(rows: list[tuple[Any, ...]]) -> list[str]:
    """Each column of ``rows`` (name, width, block, count, total, min, max, first_step, last_step,
    first_time) as the text of a PostgreSQL array, one parameter a column.

    Django's PostgreSQL cursor binds on the client: a list parameter is rendered element by element
    (~25 µs a row of 11 values: ~50 ms for a batch's 2,000 blocks); a string is quoted once. The
    elements as COPY writes them (``bulk.copy_text``): integers in decimal, a float as its ``repr``
    (read back as the same double), a time in ISO 8601; a name between double quotes with its
    backslashes and double quotes escaped (PostgreSQL's "Array Value Input")."""
    names, widths, blocks, counts, totals, lows, highs, firsts, lasts, times = zip(*rows, strict=True)
    # A batch has tens of names and one time an event, each in several rows: each written once.
    quoted = {name: '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"' for name in set(names)}
    stamps = {time: time.isoformat() for time in set(times)}

    def array(items: Any) -> str:
        return "{" + ",".join(items) + "}"

    return [
        array(map(quoted.__getitem__, names)),
        *(array(map(str, column)) for column in (widths, blocks, counts)),
        *(array(map(repr, map(float, column))) for column in (totals, lows, highs)),
        *(array(map(str, column)) for column in (firsts, lasts)),
        array(map(stamps.__getitem__, times)),
    ]


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
