"""The engine's output (its ``engine.log``: stderr and stdout of every rank, native libraries, the
vLLM engine, progress bars), received in byte chunks over the ingest socket (``store_output``).

Two copies, for two uses:

- the whole file, byte for byte, in ``<data dir>/run-logs/<run id>.log`` (``full_log_path``): the
  run page offers it for download. Its committed length is ``Run.output_kept_bytes``; bytes past it
  (written by a transaction that then failed) are cut before the next chunk is appended. The file
  stops growing at ``settings.FULL_LOG_MAX_BYTES`` with a line that says so, for good (a cap
  raised later does not reopen it): ``Run.output_file_bytes`` goes on counting what was received,
  so line offsets stay one byte space, and the lines past the cap still reach the Logs tab.
- its lines, as ``OutputLine`` rows for the Logs tab (level guessed from the text, searchable,
  live): only the newest ``OUTPUT_LINES_KEPT`` of a run are kept (``Run.output_lines_dropped``
  counts the rest, which the page says, pointing at the download).

Idempotent like the events, with a byte cursor of its own: ``Run.output_bytes``, a byte offset in
the worker's output file ``Run.output_stream`` (host, device, inode). A chunk that starts before
the cursor has its known part skipped (a resend after a lost ack), one that starts after it is
refused with the cursor (resend from there), so a worker that reconnects, or a web app that
restarts, neither doubles nor loses a line. A worker names the file it ships: the same one (a run
resumed on the machine of its lost worker appends to it) goes on from the cursor, so what the lost
engine wrote after its worker died arrives too; another one (a new machine) starts a new stream
where its engine's output begins, appended to the full log after a marker line.

Whatever the bytes hold, nothing here fails on them: ``engine.output_lines`` turns them into
lines a page can show (invalid UTF-8, control characters, terminal escapes, huge lines; the
engine's mirrored log records, on the page already as events, left out).
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.http import StreamingHttpResponse
from django.utils import timezone

from engine.contracts import CLOSE_BAD_TOKEN
from engine.output_lines import split_lines
from tributary.events import clean_text
from tributary.protocol import OUTPUT_CHUNK_BYTES, OUTPUT_STREAM_MAX_CHARS
from webapp.live import announce
from webapp.runs.models import OutputLine, Run
from webapp.runs.tokens import TokenRejected, check_holder

OUTPUT_LINES_KEPT = 5000
LIVE_LINES = 1000  # lines of one chunk sent to the pages live
FULL_LOG_DIR = "run-logs"


class NoOutputYet(LookupError):
    """The run's engine has written no output the web app holds (no full log to download)."""


class OutputRefused(ValueError):
    """An ``output`` message that breaks the protocol (the field and the fix are in the message)."""


def full_log_path(run_id: int) -> Path:
    """Where the web app keeps a run's full output log (in its data directory)."""
    return Path(settings.DATA_DIR) / FULL_LOG_DIR / f"{int(run_id)}.log"


def decode_chunk(stream: object, offset: object, data: object) -> tuple[str, int, bytes]:
    """The ``stream``, ``offset`` and ``data`` fields of an ``output`` message, checked."""
    if not isinstance(stream, str) or not 0 < len(stream) <= OUTPUT_STREAM_MAX_CHARS or "\x00" in stream:
        raise OutputRefused(
            f"output: 'stream' must name the output file in 1 to {OUTPUT_STREAM_MAX_CHARS} characters "
            "(host:device:inode)"
        )
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 2**62:
        raise OutputRefused(
            f"output: 'offset' must be an integer byte position >= 0, got {clean_text(repr(offset))[:40]}"
        )
    if not isinstance(data, str):
        raise OutputRefused("output: 'data' must be a base64 string of the output's bytes")
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise OutputRefused("output: 'data' is not valid base64") from None
    if len(raw) > OUTPUT_CHUNK_BYTES:
        raise OutputRefused(f"output: 'data' holds {len(raw)} bytes; the limit is {OUTPUT_CHUNK_BYTES}")
    return clean_text(stream), offset, raw


def line_out(line: OutputLine) -> dict[str, Any]:
    """An output line as JSON for the page (live and caught up alike)."""
    return {"offset": line.offset, "level": line.level, "message": line.message, "time": _ts(line.time)}


def _ts(value: datetime) -> float:
    return value.timestamp()


def _cap_line(cap: int) -> bytes:
    return (
        f"\n----- the web app keeps the first {cap / 2**20:g} MiB of this run's output (FULL_LOG_MAX_MB); "
        "the engine.log in the run's directory on its worker has all of it -----\n"
    ).encode()


def store_output(run_id: int, attempt: int, stream: str, offset: int, data: bytes, claim: str = "") -> int:
    """Store bytes of the output file ``stream`` from its byte ``offset`` on, shipped by the worker
    of ``attempt``; see the module docstring. Returns the cursor after it (what the socket acks).
    Raises ``TokenRejected`` for an attempt the run has moved past, or for an external run's
    script that no longer holds it (``claim``: ``tokens.check_holder``)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        if attempt != run.attempt:
            raise TokenRejected(
                CLOSE_BAD_TOKEN,
                f"the output is of attempt {attempt} of run {run_id}; the run is at attempt {run.attempt}",
            )
        check_holder(run, claim)
        new_stream = stream != run.output_stream
        held = offset if new_stream else run.output_bytes
        if offset > held:
            return held  # a gap: the worker resends from the cursor
        data = data[held - offset :]
        if not data:
            return held
        prefix = b""
        if new_stream and run.output_file_bytes:
            prefix = f"\n----- attempt {attempt}: the output of another engine.log -----\n".encode()
        start = run.output_file_bytes + len(prefix)
        kept = _keep(run, prefix + data)
        now = timezone.now()
        found = split_lines(prefix + data, run.output_file_bytes)
        # Lines the bound would delete at once are not written at all (a burst of a chatty process).
        rows = [
            OutputLine(run=run, offset=at, level=level, message=text, time=now)
            for at, level, text in found[-OUTPUT_LINES_KEPT:]
        ]
        OutputLine.objects.bulk_create(rows, batch_size=1000, ignore_conflicts=True)
        dropped = len(found) - len(rows) + _keep_newest(run)
        Run.objects.filter(pk=run.pk).update(
            output_stream=stream,
            output_bytes=held + len(data),
            output_file_bytes=start + len(data),
            output_kept_bytes=kept,
            output_lines_dropped=run.output_lines_dropped + dropped,
        )
        live = [line_out(r) for r in rows[-LIVE_LINES:]]
        if live:
            # A burst (a chunk is up to 1 MiB) goes out as its newest lines, saying how many it left out.
            announce.output_stored(run_id, live, skipped=len(found) - len(live))
    return held + len(data)


def _keep(run: Run, blob: bytes) -> int:
    """Append what of ``blob`` the full log file keeps; its committed length after. Until the cap
    the file holds exactly what was received (its length equals ``output_file_bytes``); once it
    reached the cap and ended with the line saying so, it is not touched again."""
    kept = run.output_kept_bytes
    if kept != run.output_file_bytes:
        return kept  # capped for good
    cap = settings.FULL_LOG_MAX_BYTES
    part = blob[: max(0, cap - kept)]
    cut = _cap_line(cap) if len(part) < len(blob) else b""
    path = full_log_path(run.pk)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        fh.truncate(kept)  # what a failed transaction wrote after the committed end
        fh.write(part + cut)
        fh.flush()
        os.fsync(fh.fileno())  # on disk before the length that counts it commits
    return kept + len(part) + len(cut)


def _keep_newest(run: Run) -> int:
    """Delete the run's output lines older than the newest ``OUTPUT_LINES_KEPT``; how many went."""
    cutoff = (
        OutputLine.objects.filter(run=run)
        .order_by("-offset")
        .values_list("offset", flat=True)[OUTPUT_LINES_KEPT : OUTPUT_LINES_KEPT + 1]
    )
    edge = list(cutoff)
    if not edge:
        return 0
    deleted, _ = OutputLine.objects.filter(run=run, offset__lte=edge[0]).delete()
    return deleted


def output_lines(run: Run, *, after: int = -1, limit: int = 500) -> list[OutputLine]:
    """The run's output lines after byte ``after``: the newest ``limit`` of them, oldest first."""
    rows = list(OutputLine.objects.filter(run=run, offset__gt=after).order_by("-offset")[:limit])
    rows.reverse()
    return rows


def output_page(run: Run, *, after: int = -1, limit: int = 500) -> dict[str, Any]:
    """The kept output lines after byte ``after``, oldest first, for paging forward (the API):
    ``next_after`` goes on from the last, ``dropped`` counts lines no longer kept as rows (the
    full log has them)."""
    rows = list(OutputLine.objects.filter(run=run, offset__gt=after).order_by("offset")[: limit + 1])
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {
        "items": [{"offset": r.offset, "level": r.level, "message": r.message, "time": r.time} for r in rows],
        "next_after": rows[-1].offset if rows else after,
        "has_more": has_more,
        "dropped": run.output_lines_dropped,
        "full_log_bytes": run.output_kept_bytes,
    }


def full_log_response(run: Run, *, asynchronous: bool, missing_ok: bool = False) -> StreamingHttpResponse:
    """The run's full engine output as received so far (its committed part, ``output_kept_bytes``),
    streamed as a text file download. None yet: ``NoOutputYet``, or an empty file with
    ``missing_ok``. Under ASGI the body is an async iterator: Django reads a sync iterator whole
    into memory there first."""
    path = full_log_path(run.pk)
    size = run.output_kept_bytes
    if size and not path.is_file():
        size = 0
    if not size and not missing_ok:
        raise NoOutputYet(
            f"run {run.pk}'s engine has written no output yet (its worker sends it as the run goes)"
        )
    blocks = _blocks(path, size)
    response = StreamingHttpResponse(
        _async_blocks(blocks) if asynchronous else blocks, content_type="text/plain; charset=utf-8"
    )
    response["Content-Disposition"] = f'attachment; filename="run-{run.pk}-engine.log"'
    response["Content-Length"] = str(size)
    response["Cache-Control"] = "no-store"
    return response


def _blocks(path: Path, size: int, block: int = 256 * 1024) -> Iterator[bytes]:
    """The first ``size`` bytes of the file (its committed part: a chunk being stored may be
    past it), in blocks, so a long log is never held in memory whole."""
    if size <= 0:
        return
    with path.open("rb") as handle:
        left = size
        while left > 0:
            data = handle.read(min(block, left))
            if not data:
                return
            left -= len(data)
            yield data


async def _async_blocks(blocks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``blocks`` for an ASGI server, each read in a worker thread."""
    read = sync_to_async(next, thread_sensitive=False)
    while (data := await read(blocks, None)) is not None:
        yield data
