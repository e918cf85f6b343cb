"""Writing metric points fast: the one hot write path of the web app.

A metrics event carries tens of values and a run sends one or more per step, so ingest
writes far more metric points than anything else. Building a Django model instance per
point and letting ``bulk_create`` render the INSERT costs ~120 µs a point (profiled:
2.1 s for 25,000 points on PostgreSQL). Here the rows go straight to the database:

- PostgreSQL: ``COPY`` straight into the table, inside a savepoint, the rows sent as one block of
  COPY's text format built here (``copy_text``): each metric name escaped and each event's time
  formatted once, not per row, and a float written as its ``repr`` (the shortest text that reads
  back as the same double). psycopg's ``write_row`` adapts each of the 8 values of every row on
  its own: 4 µs a row, the largest Python cost of storing a batch (issue 19); this is ~1 µs. Ingest only stores
  events after the run's cursor, so a conflict on (run, name, step) is rare (an engine
  sending one metric twice for a step of one attempt); then the savepoint is rolled back and the rows go
  through a session-local staging table and ``INSERT ... SELECT ... ON CONFLICT DO
  NOTHING`` (a point already stored keeps its first value). COPY alone costs what the
  physical reference of ``bench/ingest.py`` costs; the staging route costs about twice that.
- SQLite: ``executemany`` of ``INSERT OR IGNORE``.

Must run inside the caller's transaction (ingest holds the run's row lock).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction

from webapp.runs.models import MetricPoint

# (run_id, name, step, value, time, seq, attempt)
PointRow = tuple[int, str, int, float, datetime, int, int]

_COLUMNS = "run_id, name, step, value, time, seq, attempt, superseded"
_STAGE = "tributary_metric_stage"


def insert_metric_points(rows: Sequence[PointRow]) -> None:
    if not rows:
        return
    table = connection.ops.quote_name(MetricPoint._meta.db_table)
    if connection.vendor == "postgresql":
        _insert_postgresql(table, rows)
    else:
        adapt = connection.ops.adapt_datetimefield_value
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT OR IGNORE INTO {table} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                [
                    (run, name, step, value, adapt(time), seq, att, False)
                    for run, name, step, value, time, seq, att in rows
                ],
            )


def _insert_postgresql(table: str, rows: Sequence[PointRow]) -> None:
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            _copy(cursor.cursor, table, rows)  # psycopg's own cursor: Django's wrapper has no COPY
        return
    except IntegrityError:
        pass  # some point is stored already: keep the stored one, insert the rest
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (run_id bigint, name varchar(200), step integer, "
            "value double precision, time timestamptz, seq bigint, attempt integer, superseded boolean) "
            "ON COMMIT DELETE ROWS"
        )
        _copy(cursor.cursor, _STAGE, rows)
        cursor.execute(
            f"INSERT INTO {table} ({_COLUMNS}) SELECT {_COLUMNS} FROM {_STAGE} "
            "ON CONFLICT (run_id, name, step, attempt) DO NOTHING"
        )
        cursor.execute(f"TRUNCATE {_STAGE}")


def _copy(cursor: Any, table: str, rows: Sequence[PointRow]) -> None:
    data = copy_text(rows)
    # wrap_database_errors: psycopg's errors become Django's (IntegrityError above), as they
    # do for queries that go through Django's cursor.
    with connection.wrap_database_errors, cursor.copy(f"COPY {table} ({_COLUMNS}) FROM STDIN") as copy:
        copy.write(data)


_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def copy_text(rows: Sequence[PointRow]) -> str:
    """``rows`` (and ``superseded`` false) as the data of ``COPY ... FROM STDIN`` in text format.

    The format (PostgreSQL's COPY reference, "Text Format"): a line a row, columns split by tabs,
    backslash, tab, newline and carriage return in a value escaped with a backslash. Only a
    metric name can hold those; numbers and ISO 8601 times cannot. A float is written as its
    ``repr``, which ``float8in`` reads back as the same double (the shortest round-trip text,
    PostgreSQL 12+ prints and reads it so too); a value that is not a float goes through
    ``float()`` first, so a bad one fails here as a ``TypeError``/``ValueError`` (ingest's
    ``is_poison``), as it would in the driver."""
    names = {name: name.translate(_ESCAPES) for name in {row[1] for row in rows}}
    times = {t: "\\N" if t is None else t.isoformat() for t in {row[4] for row in rows}}
    return "".join(
        [
            f"{run}\t{names[name]}\t{step:d}\t{value if type(value) is float else float(value)!r}\t"
            f"{times[time]}\t{seq:d}\t{attempt:d}\tf\n"
            for run, name, step, value, time, seq, attempt in rows
        ]
    )
