"""Rebuild a run's stored events from the database, in seq order, for the run socket.

Metric points, samples, checkpoints and log lines keep the ``seq`` of the event that brought
them, so the events after any cursor can be rebuilt exactly as the fan-out sent them live.
Status and heartbeat events are not stored as rows (the run row holds the status), so a
replay skips their numbers: the browser's cursor is "the highest seq seen", never a count.
Events with a step carry the ``attempt`` that logged them, as they did live (``ingest._public``),
so a page replaying a resumed run applies its rewinds as it would have live.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby
from typing import Any

from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Sample

# Events per replayed chunk: bounded so a consumer never loads a long run's history at once
# (a samples event holds up to a few hundred rows).
CHUNK_SEQS = 200


def stored_events(run_id: int, after_seq: int, upto_seq: int) -> Iterator[list[dict[str, Any]]]:
    """Yield lists of the run's stored events with ``after_seq < seq <= upto_seq``, in order."""
    low = after_seq
    while low < upto_seq:
        high = min(upto_seq, low + CHUNK_SEQS)
        events = _events_between(run_id, low, high)
        if events:
            yield events
        low = high


def _events_between(run_id: int, low: int, high: int) -> list[dict[str, Any]]:
    window = {"run_id": run_id, "seq__gt": low, "seq__lte": high}
    events: list[dict[str, Any]] = []
    points = (
        MetricPoint.objects.filter(**window)
        .order_by("seq", "name")
        .values_list("seq", "step", "time", "attempt", "name", "value")
    )
    for seq, rows in groupby(points, key=lambda row: row[0]):
        rows = list(rows)
        events.append(
            {
                "seq": seq,
                "type": "metrics",
                "step": rows[0][1],
                "time": rows[0][2].timestamp(),
                "values": {name: value for *_, name, value in rows},
                "attempt": rows[0][3],
            }
        )
    samples = Sample.objects.filter(**window).order_by("seq", "index")
    for seq, items in groupby(samples, key=lambda s: s.seq):
        items = list(items)
        events.append(
            {
                "seq": seq,
                "type": "samples",
                "step": items[0].step,
                "items": [s.item() for s in items],
                "attempt": items[0].attempt,
            }
        )
    deleted: dict[int, list[int]] = {}  # a checkpoint's seq -> the seqs of those its save deleted
    gone = Checkpoint.objects.filter(run_id=run_id, deleted_at_seq__gt=low, deleted_at_seq__lte=high)
    for by, seq in gone.order_by("deleted_at_seq", "seq").values_list("deleted_at_seq", "seq"):
        deleted.setdefault(by, []).append(seq)
    for ckpt in Checkpoint.objects.filter(**window):
        events.append(
            {
                "seq": ckpt.seq,
                "type": "checkpoint",
                "step": ckpt.step,
                "path": ckpt.path,
                "bytes": ckpt.bytes,
                "attempt": ckpt.attempt,
                "deleted_seqs": deleted.get(ckpt.seq, []),
            }
        )
    for line in LogLine.objects.filter(**window):
        events.append({"seq": line.seq, "type": "log", "level": line.level, "message": line.message})
    events.sort(key=lambda e: e["seq"])
    return events
