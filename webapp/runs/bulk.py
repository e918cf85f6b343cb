"""Writing metric points fast: the one hot write path of the web app.

A metrics event carries tens of values and a run sends one or more per step, so ingest
writes far more metric points than anything else. Building a Django model instance per
point and letting ``bulk_create`` render the INSERT costs ~120 µs a point (profiled:
2.1 s for 25,000 points on PostgreSQL). Here the rows go straight to the database:

- PostgreSQL: ``COPY`` straight into the table, inside a savepoint, the rows sent as one block of
  COPY's text format built here (``copy_text``). The points come grouped as ingest has them, one
  metrics event a group (``PointGroup``: its run, step, time, seq and attempt, and its values), and
  the COPY lists those columns first: the start of a line is formatted once an event, each point
  adds its escaped name and its value's ``repr`` (the shortest text that reads back as the same
  double). psycopg's ``write_row`` adapts each of the 8 values of every row on its own: 4 µs a
  row, the largest Python cost of storing a batch (issue 19); a line formatted whole is ~2 µs, a
  line of a group ~0.7 µs. Ingest only stores
  events after the run's cursor, so a conflict on (run, name, step) is rare (an engine
  sending one metric twice for a step of one attempt); then the savepoint is rolled back and the rows go
  through a session-local staging table and ``INSERT ... SELECT ... ON CONFLICT DO
  NOTHING`` (a point already stored keeps its first value). COPY alone costs what the
  physical reference of ``bench/ingest.py`` costs; the staging route costs about twice that.
- SQLite: ``executemany`` of ``INSERT OR IGNORE``.

Both say whether every point was inserted (COPY, or as many rows changed as were sent): the
analysis kept at ingest (``webapp.analysis.rollups``) then aggregates the points it holds instead of
reading them back.

Must run inside the caller's transaction (ingest holds the run's row lock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from django.db import IntegrityError, connection, transaction

from webapp.runs.models import MetricPoint

# (run_id, name, step, value, time, seq, attempt)
PointRow = tuple[int, str, int, float, datetime, int, int]


class PointGroup(NamedTuple):
    """One metrics event's points, as ingest hands them to the insert, the summaries and the rollups."""

    run_id: int
    step: int
    time: datetime
    seq: int
    attempt: int
    values: Mapping[str, float]  # {name: value}


_COLUMNS = "run_id, name, step, value, time, seq, attempt, superseded"
_COPY_COLUMNS = "run_id, step, time, seq, attempt, superseded, name, value"  # copy_text's order
_STAGE = "tributary_metric_stage"


def insert_metric_points(rows: Sequence[PointRow]) -> bool:
    """Insert ``rows`` (any runs'), a point already stored keeping its first value; whether every
    row was inserted. Each row is a group of one (``insert_point_groups``)."""
    return insert_point_groups(
        [
            PointGroup(run, step, time, seq, att, {name: value})
            for run, name, step, value, time, seq, att in rows
        ]
    )


def insert_point_groups(groups: Sequence[PointGroup]) -> bool:
    """Insert the points of ``groups``, a point already stored (or twice in them) keeping its first
    value; return whether every point was inserted (False: some were ignored as stored already)."""
    if not any(group.values for group in groups):
        return True
    table = connection.ops.quote_name(MetricPoint._meta.db_table)
    if connection.vendor == "postgresql":
        return _insert_postgresql(table, groups)
    adapt = connection.ops.adapt_datetimefield_value
    rows = [
        (run, name, step, value, adapt(time), seq, att, False)
        for run, step, time, seq, att, values in groups
        for name, value in values.items()
    ]
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT OR IGNORE INTO {table} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", rows
        )
        # sqlite3 sums the rows each statement changed: an ignored one changed none.
        return cursor.rowcount == len(rows)


def _insert_postgresql(table: str, groups: Sequence[PointGroup]) -> bool:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            _copy(cursor.cursor, table, groups)  # psycopg's own cursor: Django's wrapper has no COPY
        return True
    except IntegrityError:
        pass  # some point is stored already: keep the stored one, insert the rest
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (run_id bigint, name varchar(200), step integer, "
            "value double precision, time timestamptz, seq bigint, attempt integer, superseded boolean) "
            "ON COMMIT DELETE ROWS"
        )
        _copy(cursor.cursor, _STAGE, groups)
        cursor.execute(
            f"INSERT INTO {table} ({_COLUMNS}) SELECT {_COLUMNS} FROM {_STAGE} "
            "ON CONFLICT (run_id, name, step, attempt) DO NOTHING"
        )
        cursor.execute(f"TRUNCATE {_STAGE}")
    return False


def _copy(cursor: Any, table: str, groups: Sequence[PointGroup]) -> None:
    data = copy_text(groups)
    # wrap_database_errors: psycopg's errors become Django's (IntegrityError above), as they
    # do for queries that go through Django's cursor.
    with connection.wrap_database_errors, cursor.copy(f"COPY {table} ({_COPY_COLUMNS}) FROM STDIN") as copy:
        copy.write(data)


_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def copy_text(groups: Sequence[PointGroup]) -> str:
    """The points of ``groups`` (and ``superseded`` false) as the data of ``COPY ... FROM STDIN`` in
    text format, columns in the order of ``_COPY_COLUMNS``.

    The format (PostgreSQL's COPY reference, "Text Format"): a line a row, columns split by tabs,
    backslash, tab, newline and carriage return in a value escaped with a backslash. Only a
    metric name can hold those; numbers and ISO 8601 times cannot. A float is written as its
    ``repr``, which ``float8in`` reads back as the same double (the shortest round-trip text,
    PostgreSQL 12+ prints and reads it so too); a value that is not a float goes through
    ``float()`` first, so a bad one fails here as a ``TypeError``/``ValueError`` (ingest's
    ``is_poison``), as it would in the driver. The columns an event's points share come first,
    formatted once an event: a point adds its name and value."""
    names: dict[str, str] = {}
    lines: list[str] = []
    for run, step, time, seq, attempt, values in groups:
        if not values:
            continue
        for name in values:
            if name not in names:
                names[name] = name.translate(_ESCAPES)
        stamp = "\\N" if time is None else time.isoformat()
        head = f"{run:d}\t{step:d}\t{stamp}\t{seq:d}\t{attempt:d}\tf\t"
        lines.extend(
            [
                f"{head}{names[name]}\t{value if type(value) is float else float(value)!r}\n"
                for name, value in values.items()
            ]
        )
    return "".join(lines)
