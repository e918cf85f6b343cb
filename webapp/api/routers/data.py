"""What a run logged: metric names, series (downsampled in the database), CSV export, samples."""

from __future__ import annotations

from typing import Any, Literal

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Query, Router

from webapp.api import queries
from webapp.api.routers import READ, Id
from webapp.api.schemas import MetricNameOut, SamplePage, SampleStepOut, SeriesSetOut
from webapp.inputs import BIGINT_MAX, INT_MAX
from webapp.runs.models import Run
from webapp.teams.access import run_for
from webapp.teams.choices import Role

router = Router(tags=["metrics and samples"])

SampleSort = Literal["step", "-step", "reward", "-reward", "length", "-length"]

# Query parameters shared with the read-only share API (webapp.api.routers.shares).
NAMES = Query(None, description="Metric names, comma-separated or repeated; default: all.")
EXCLUDE = Query(
    None,
    description="Metric names to leave out, as for names (a page that already holds some asks for the rest).",
)
MAX_POINTS = Query(
    1000, ge=10, le=20_000, description="Downsample a longer series to about this many points."
)
AFTER_STEP = Query(None, ge=-1, le=INT_MAX, description="Only points after this step (live updates).")
X_AXIS = Query("step", description="Bucket along steps or wall-clock time when downsampling.")
STEP = Query(None, description="A step number, or 'latest' for the last step that has samples.")
SEARCH = Query("", max_length=500, description="Text in the prompt or the completion (case-insensitive).")
SAMPLE_SORT = Query("step", description="Order: reward, length or step; '-' for descending.")
LIMIT = Query(50, ge=1, le=500)
OFFSET = Query(0, ge=0, le=BIGINT_MAX)
CSV_FORMAT = Query("wide", description="wide: step + one column per metric; long: step,name,value,time.")
CSV_DOC = {
    "responses": {200: {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}}}
}


def is_asgi(request: HttpRequest) -> bool:
    """Served by an ASGI server: a streamed body must then be an async iterator."""
    return isinstance(request, ASGIRequest)


def series_response(
    run: Run,
    names: list[str] | None,
    exclude: list[str] | None,
    max_points: int,
    after_step: int | None,
    x: str,
) -> Any:
    return {
        "run_id": run.pk,
        "x": x,
        "max_points": max_points,
        "series": queries.metric_series(
            run,
            queries.split_names(names),
            exclude=queries.split_names(exclude),
            max_points=max_points,
            after_step=after_step,
            x=x,
        ),
    }


@router.get(
    "/runs/{run_id}/metrics", response={200: list[MetricNameOut], **READ}, summary="A run's metric names"
)
def list_metrics(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Each metric with its number of points, step range and last value."""
    return queries.metric_names(run_for(request.auth, run_id, Role.VIEWER))


@router.get("/runs/{run_id}/metrics/series", response={200: SeriesSetOut, **READ}, summary="Metric series")
def metric_series(
    request: HttpRequest,
    run_id: Id,
    names: list[str] | None = NAMES,
    exclude: list[str] | None = EXCLUDE,
    max_points: int = MAX_POINTS,
    after_step: int | None = AFTER_STEP,
    x: Literal["step", "time"] = X_AXIS,
) -> Any:
    """Per metric: ``step[]``, ``value[]`` and ``time[]`` (Unix seconds).

    A series longer than ``max_points`` is downsampled in the database: the first and last
    points are kept as they are and the points between go into equal-width buckets along
    ``x``, each reported by its first step and time, its mean value, and ``min[]``/``max[]``
    for a band (``downsampled: true``)."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    return series_response(run, names, exclude, max_points, after_step, x)


@router.get(
    "/runs/{run_id}/metrics.csv", response=READ, summary="Export metrics as CSV", openapi_extra=CSV_DOC
)
def metrics_csv(
    request: HttpRequest,
    run_id: Id,
    format: Literal["wide", "long"] = CSV_FORMAT,
    names: list[str] | None = NAMES,
) -> StreamingHttpResponse:
    """Streamed from the database; values read back as exactly the stored numbers."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    return queries.metrics_csv(run, queries.split_names(names), format, asynchronous=is_asgi(request))


@router.get(
    "/runs/{run_id}/samples", response={200: SamplePage, **READ}, summary="A run's samples (rollouts)"
)
def list_samples(
    request: HttpRequest,
    run_id: Id,
    step: str | None = STEP,
    q: str = SEARCH,
    sort: SampleSort = SAMPLE_SORT,
    limit: int = LIMIT,
    offset: int = OFFSET,
) -> dict[str, Any]:
    """Paged; filter by step (or ``latest``) and text, sort by reward, length or step."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    return queries.sample_page(run, step=step, q=q.strip(), sort=sort, limit=limit, offset=offset)


@router.get(
    "/runs/{run_id}/samples/steps",
    response={200: list[SampleStepOut], **READ},
    summary="Steps that have samples",
)
def list_sample_steps(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Each step with samples and how many, in step order (for a step slider)."""
    return queries.sample_steps(run_for(request.auth, run_id, Role.VIEWER))
