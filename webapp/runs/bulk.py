"""Writing metric points fast: the one hot write path of the web app.

A metrics event carries tens of values and a run sends one or more per step, so ingest
writes far more metric points than anything else. Building a Django model instance per
point and letting ``bulk_create`` render the INSERT costs ~120 µs a point (profiled:
2.1 s for 25,000 points on PostgreSQL). Here the rows go straight to the database:

- PostgreSQL: ``COPY`` straight into the table, inside a savepoint, the rows sent as one block of
  COPY's binary format built here (``copy_data``). The points come grouped as ingest has them, one
  metrics event a group (``PointGroup``: its run, step, time, seq and attempt, and its values), and
  the COPY lists those columns first: the start of a row is packed once an event, each point adds
  its name's field and its value's 8 bytes. psycopg's ``write_row`` adapts each of the 8 values of
  every row on its own: 4 µs a row, the largest Python cost of storing a batch (issue 19); a row
  of a group is ~0.5 µs. Ingest only stores events after the run's cursor, so a conflict on
  (run, name, step) is rare (an engine sending one metric twice for a step of one attempt); then
  the savepoint is rolled back and the rows go through a session-local staging table and
  ``INSERT ... SELECT ... ON CONFLICT DO NOTHING`` (a point already stored keeps its first
  value). The COPY costs the backend less than the text COPY of ``bench/ingest.py``'s reference
  (no number or time to parse); the staging route costs about twice that.
- SQLite: ``executemany`` of ``INSERT OR IGNORE``.

Both say whether every point was inserted (COPY, or as many rows changed as were sent): the
analysis kept at ingest (``webapp.analysis.rollups``) then aggregates the points it holds instead of
reading them back.

Must run inside the caller's transaction (ingest holds the run's row lock).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
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
_COPY_COLUMNS = "run_id, step, time, seq, attempt, superseded, name, value"  # copy_data's order
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


def insert_point_groups(groups: Sequence[PointGroup], *, data: Any = None) -> bool:
    """Insert the points of ``groups``, a point already stored (or twice in them) keeping its first
    value; return whether every point was inserted (False: some were ignored as stored already).
    ``data``: ``insert_data(groups)``, when the caller built it before (ingest's ``Prepared``)."""
    if not any(group.values for group in groups):
        return True
    if data is None:
        data = insert_data(groups)
    table = _points_table()
    if connection.vendor == "postgresql":
        return _insert_postgresql(table, data)
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT OR IGNORE INTO {table} ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", data
        )
        # sqlite3 sums the rows each statement changed: an ignored one changed none.
        return cursor.rowcount == len(data)


def insert_data(groups: Sequence[PointGroup]) -> Any:
    """What ``insert_point_groups`` sends for ``groups``: COPY's binary data (``copy_data``) on PostgreSQL,
    the rows of the ``executemany`` on SQLite. Pure Python, reading no database: ingest builds it
    before it takes the run's row lock, beside the batch before in the database (issue 19)."""
    if connection.vendor == "postgresql":
        return copy_data(groups)
    adapt = connection.ops.adapt_datetimefield_value
    return [
        (run, name, step, value, adapt(time), seq, att, False)
        for run, step, time, seq, att, values in groups
        for name, value in values.items()
    ]


def copy_points(data: bytes) -> None:
    """COPY ``data`` (``copy_data``) into the points table, in a savepoint: a COPY the database
    refuses (a point stored already: ``IntegrityError``) writes nothing and leaves the caller's
    transaction usable. PostgreSQL only."""
    with transaction.atomic(), connection.cursor() as cursor:
        _copy(cursor.cursor, _points_table(), data)  # psycopg's own cursor: Django's wrapper has no COPY


def _points_table() -> str:
    return connection.ops.quote_name(MetricPoint._meta.db_table)


def _insert_postgresql(table: str, data: bytes) -> bool:
    try:
        copy_points(data)
        return True
    except IntegrityError:
        pass  # some point is stored already: keep the stored one, insert the rest
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (run_id bigint, name varchar(200), step integer, "
            "value double precision, time timestamptz, seq bigint, attempt integer, superseded boolean) "
            "ON COMMIT DELETE ROWS"
        )
        _copy(cursor.cursor, _STAGE, data)
        cursor.execute(
            f"INSERT INTO {table} ({_COLUMNS}) SELECT {_COLUMNS} FROM {_STAGE} "
            "ON CONFLICT (run_id, name, step, attempt) DO NOTHING"
        )
        cursor.execute(f"TRUNCATE {_STAGE}")
    return False


def _copy(cursor: Any, table: str, data: bytes) -> None:
    # wrap_database_errors: psycopg's errors become Django's (IntegrityError above), as they
    # do for queries that go through Django's cursor.
    with connection.wrap_database_errors, cursor.copy(f"COPY {table} ({_COPY_COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(data)


_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)  # signature, flags, no extension
_TRAILER = struct.pack(">h", -1)
_HEAD = struct.Struct(">hiqiiiqiqiiib")  # 8 fields; run_id, step, time, seq, attempt, superseded
_VALUE = struct.Struct(">d")
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def copy_data(groups: Sequence[PointGroup]) -> bytes:
    """The points of ``groups`` (and ``superseded`` false) as the data of ``COPY ... FROM STDIN
    (FORMAT BINARY)``, columns in the order of ``_COPY_COLUMNS``.

    Binary, not text: PostgreSQL reads a double and a time as they are instead of parsing their
    text (float8in, timestamptz_in), 12% less of the backend's time for the COPY of a batch
    (issue 19: 0.40-0.44 s against 0.46-0.50 s for 100,000 points) for the same Python here. The
    format (PostgreSQL's COPY reference, "Binary Format"): a header, then a row as its field count
    and each field as its length and its bytes in network order: bigint and integer as such, a
    time as microseconds since 2000-01-01 UTC (``timestamptz``'s own), a boolean as one byte, a
    name as its UTF-8, a value as an IEEE double (the same bits as the float: nothing rounds). The
    columns an event's points share come first, packed once an event, and a name's field once a
    batch: a point adds its name's field and its value. A value that is not a float goes through
    ``float()`` first, and a number out of its column's range or a name that cannot be encoded
    raises ``ValueError`` here, as a bad value does in the driver (ingest's ``is_poison``)."""
    names: dict[str, bytes] = {}
    parts = [_HEADER]
    pack_value = _VALUE.pack
    try:
        for run, step, time, seq, attempt, values in groups:
            if not values:
                continue
            for name in values:
                if name not in names:
                    encoded = name.encode()
                    names[name] = struct.pack(">i", len(encoded)) + encoded + b"\x00\x00\x00\x08"
            micros = (time - _PG_EPOCH) // _MICROSECOND
            head = _HEAD.pack(8, 8, run, 4, step, 8, micros, 8, seq, 4, attempt, 1, 0)
            parts.extend(
                [
                    head + names[name] + pack_value(value if type(value) is float else float(value))
                    for name, value in values.items()
                ]
            )
    except struct.error as exc:  # a number out of its column's range
        raise ValueError(f"a metric point the database cannot hold: {exc}") from exc
    parts.append(_TRAILER)
    return b"".join(parts)
