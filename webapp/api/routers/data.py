"""What a run logged: metric names, series (downsampled in the database), CSV export, samples."""

from __future__ import annotations

from typing import Any, Literal

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from ninja import Field, Query, Router, Schema

from webapp.api import serializers
from webapp.api.routers import READ, Id
from webapp.api.schemas import MetricNameOut, SamplePage, SampleStepOut, SeriesSetOut
from webapp.inputs import BIGINT_MAX, INT_MAX
from webapp.runs import selectors
from webapp.runs.models import Run
from webapp.teams.access import run_for
from webapp.teams.choices import Role

router = Router(tags=["metrics and samples"])

SampleSort = Literal["step", "-step", "reward", "-reward", "length", "-length"]

CSV_DOC = {
    "responses": {200: {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}}}
}


# The query parameters of each read, declared once for the team API (``/runs/{id}/...``) and the
# read-only share API (``/shared/{token}/...``, webapp.api.routers.shares); ninja lists their
# fields as separate query parameters, and a bad one is a 422 naming it (``["query", name]``).
class SeriesQuery(Schema):
    names: list[str] | None = Field(
        None, description="Metric names, comma-separated or repeated; default: all."
    )
    exclude: list[str] | None = Field(
        None,
        description="Metric names to leave out, as for names (a page that already holds some asks for the rest).",
    )
    max_points: int = Field(
        1000, ge=10, le=20_000, description="Downsample a longer series to about this many points."
    )
    after_step: int | None = Field(
        None, ge=-1, le=INT_MAX, description="Only points after this step (live updates)."
    )
    x: Literal["step", "time"] = Field(
        "step", description="Bucket along steps or wall-clock time when downsampling."
    )
    superseded: bool = Field(
        False,
        description="The points a resume from an earlier step superseded (kept, not charted by default) "
        "instead of the run's history.",
    )


class CsvQuery(Schema):
    format: Literal["wide", "long"] = Field(
        "wide", description="wide: step + one column per metric; long: step,name,value,time."
    )
    names: list[str] | None = Field(
        None, description="Metric names, comma-separated or repeated; default: all."
    )


class SampleQuery(Schema):
    step: str | None = Field(
        None, description="A step number, or 'latest' for the last step that has samples."
    )
    q: str = Field("", max_length=500, description="Text in the prompt or the completion (case-insensitive).")
    sort: SampleSort = Field("step", description="Order: reward, length or step; '-' for descending.")
    limit: int = Field(50, ge=1, le=500)
    offset: int = Field(0, ge=0, le=BIGINT_MAX)


def is_asgi(request: HttpRequest) -> bool:
    """Served by an ASGI server: a streamed body must then be an async iterator."""
    return isinstance(request, ASGIRequest)


def series_response(run: Run, params: SeriesQuery) -> dict[str, Any]:
    return {
        "run_id": run.pk,
        "x": params.x,
        "max_points": params.max_points,
        "series": selectors.metric_series(
            run,
            serializers.split_names(params.names),
            exclude=serializers.split_names(params.exclude),
            max_points=params.max_points,
            after_step=params.after_step,
            x=params.x,
            superseded=params.superseded,
        ),
    }


def csv_response(request: HttpRequest, run: Run, params: CsvQuery) -> StreamingHttpResponse:
    return serializers.metrics_csv(
        run, serializers.split_names(params.names), params.format, asynchronous=is_asgi(request)
    )


def samples_response(run: Run, params: SampleQuery) -> dict[str, Any]:
    return serializers.sample_page(
        run, step=params.step, q=params.q.strip(), sort=params.sort, limit=params.limit, offset=params.offset
    )


@router.get(
    "/runs/{run_id}/metrics", response={200: list[MetricNameOut], **READ}, summary="A run's metric names"
)
def list_metrics(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Each metric with its number of points, step range and last value."""
    return selectors.metric_names(run_for(request.auth, run_id, Role.VIEWER))


def series_json(payload: dict[str, Any]) -> HttpResponse:
    """A ``SeriesSetOut`` written by pydantic-core instead of ninja's renderer (``json.dumps``
    with its encoder): a page's history is tens of thousands of floats, and for one run of the
    compare page (29 series of 315 points, 750 KB) that took 39 ms against 3.4 ms, plus 3.4 ms
    to validate. The same JSON (a float in its shortest round-trip form, as Python writes it;
    ingest stores finite values only)."""
    body = SeriesSetOut.model_validate(payload).model_dump_json()
    return HttpResponse(body, content_type="application/json")


@router.get("/runs/{run_id}/metrics/series", response={200: SeriesSetOut, **READ}, summary="Metric series")
def metric_series(request: HttpRequest, run_id: Id, params: Query[SeriesQuery]) -> HttpResponse:
    """Per metric: ``step[]``, ``value[]`` and ``time[]`` (Unix seconds).

    A series longer than ``max_points`` is downsampled in the database: the first and last
    points are kept as they are and the points between go into equal-width buckets along
    ``x``, each reported by its first step and time, its mean value, and ``min[]``/``max[]``
    for a band (``downsampled: true``)."""
    return series_json(series_response(run_for(request.auth, run_id, Role.VIEWER), params))


@router.get(
    "/runs/{run_id}/metrics.csv", response=READ, summary="Export metrics as CSV", openapi_extra=CSV_DOC
)
def metrics_csv(request: HttpRequest, run_id: Id, params: Query[CsvQuery]) -> StreamingHttpResponse:
    """Streamed from the database; values read back as exactly the stored numbers."""
    return csv_response(request, run_for(request.auth, run_id, Role.VIEWER), params)


@router.get(
    "/runs/{run_id}/samples", response={200: SamplePage, **READ}, summary="A run's samples (rollouts)"
)
def list_samples(request: HttpRequest, run_id: Id, params: Query[SampleQuery]) -> dict[str, Any]:
    """Paged; filter by step (or ``latest``) and text, sort by reward, length or step."""
    return samples_response(run_for(request.auth, run_id, Role.VIEWER), params)


@router.get(
    "/runs/{run_id}/samples/steps",
    response={200: list[SampleStepOut], **READ},
    summary="Steps that have samples",
)
def list_sample_steps(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Each step with samples and how many, in step order (for a step slider)."""
    return selectors.sample_steps(run_for(request.auth, run_id, Role.VIEWER))
