"""The run page's Logs tab: what it shows first, the lines it catches up on, the full-log download.

Two sources make one list: the engine's ``log`` events (``LogLine``: its Python log records and
warnings, the worker's words about the run, quarantined events), ordered by seq, and the lines of
its output (``OutputLine``: stderr of every rank and child process), ordered by byte offset. The
tab shows the newest of each, merged by the time they were stored; ``logs.js`` appends live ones.

Who may read them: the run page's team (viewer role and up). A share link's page has no Logs
tab: output can name paths and hosts of the worker, which a read-only link does not show.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.http import Http404, HttpRequest, JsonResponse, StreamingHttpResponse
from django.views.decorators.http import require_GET

from webapp.runs.models import LogLine, OutputLine, Run
from webapp.runs.output import NoOutputYet, full_log_response, line_out, output_lines
from webapp.teams.access import NotFound, run_for

LOG_TAIL = 500
CATCH_UP_LIMIT = 2000


def log_view(run: Run, limit: int = LOG_TAIL) -> dict[str, Any]:
    """The Logs tab as first rendered: the newest ``limit`` lines of each source, merged by time,
    and whether older lines are left out (then the page points at the download)."""
    events = list(LogLine.objects.filter(run=run).order_by("-seq")[: limit + 1])
    output = output_lines(run, limit=limit + 1)
    more = len(events) > limit or len(output) > limit or run.output_lines_dropped > 0
    events, output = events[:limit], output[-limit:]
    lines = [
        {"kind": "event", "key": e.seq, "level": e.level, "message": e.message, "time": e.time}
        for e in events
    ] + [
        {"kind": "output", "key": o.offset, "level": o.level, "message": o.message, "time": o.time}
        for o in output
    ]
    lines.sort(key=lambda line: (line["time"], line["kind"] == "output", line["key"]))
    return {
        "lines": lines,
        "older_left_out": more,
        "dropped": run.output_lines_dropped,
        "last_offset": output[-1].offset if output else -1,
        "has_full_log": run.output_file_bytes > 0,
    }


def _visible(request: HttpRequest, run_id: int) -> Run:
    """The run as its page shows it: a 404 for whoever may not see it (not their team's)."""
    try:
        return run_for(request.user, run_id)
    except NotFound as exc:
        raise Http404(str(exc)) from None


@login_required
@require_GET
def output_json(request: HttpRequest, run_id: int) -> JsonResponse:
    """Output lines after byte ``after`` (the page's cursor), for a page that may have missed
    live ones (a reconnect, the end of a run); at most ``CATCH_UP_LIMIT``, the newest."""
    run = _visible(request, run_id)
    raw = request.GET.get("after", "-1")
    digits = raw.removeprefix("-")
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        return JsonResponse(
            {
                "detail": "after: not a byte offset; send the offset of the last line the page has (-1 for all)"
            },
            status=400,
        )
    after = int(raw)
    rows = output_lines(run, after=after, limit=CATCH_UP_LIMIT)
    skipped = 0
    if len(rows) == CATCH_UP_LIMIT:  # the page missed more than it gets: it says older lines are left out
        skipped = OutputLine.objects.filter(run=run, offset__gt=after, offset__lt=rows[0].offset).count()
    return JsonResponse(
        {"lines": [line_out(r) for r in rows], "dropped": run.output_lines_dropped, "skipped": skipped}
    )


@login_required
@require_GET
def full_log(request: HttpRequest, run_id: int) -> StreamingHttpResponse:
    """The run's full engine output as received so far, streamed as a text file download."""
    run = _visible(request, run_id)
    try:
        return full_log_response(run, asynchronous=isinstance(request, ASGIRequest))
    except NoOutputYet as exc:
        raise Http404(str(exc)) from None
