"""Share links: a member makes a token that opens one run read-only, for anyone who holds it.

``/api/runs/{id}/shares`` manages a run's links (member). ``/api/shared/{token}/...`` needs no
login: the run, its metrics and its samples, nothing else; a revoked token is a 404.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from ninja import Query, Router, Status

from webapp.api import serializers
from webapp.api.routers import BAD, WRITE, Id
from webapp.api.routers.data import (
    CSV_DOC,
    CsvQuery,
    SampleQuery,
    SeriesQuery,
    csv_response,
    samples_response,
    series_json,
    series_response,
)
from webapp.api.schemas import (
    ErrorOut,
    MetricNameOut,
    RunOut,
    SamplePage,
    SampleStepOut,
    SeriesSetOut,
    ShareOut,
    ValidationErrorOut,
)
from webapp.runs import selectors
from webapp.runs.models import Run, ShareLink
from webapp.runs.sharing import revoke_share_link
from webapp.teams.access import NotFound, run_for
from webapp.teams.choices import Role

router = Router(tags=["share links"])
public_router = Router(tags=["shared (no login)"], auth=None)

# No login: no 401/403. A malformed token or parameter is a 400/422 as anywhere else.
PUBLIC: dict[int, Any] = {**BAD, 404: ErrorOut, 422: ValidationErrorOut}


@router.get(
    "/runs/{run_id}/shares", response={200: list[ShareOut], **WRITE}, summary="A run's share links (member)"
)
def list_shares(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Active and revoked links, newest first (member: a token is as good as a read-only login)."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    return [serializers.share_out(s) for s in selectors.share_links(run)]


@router.post(
    "/runs/{run_id}/shares", response={201: ShareOut, **WRITE}, summary="Create a share link (member)"
)
def create_share(request: HttpRequest, run_id: Id) -> Status[dict[str, Any]]:
    run = run_for(request.auth, run_id, Role.MEMBER)
    return Status(201, serializers.share_out(ShareLink.create(run, request.auth)))


@router.delete(
    "/runs/{run_id}/shares/{share_id}", response={204: None, **WRITE}, summary="Revoke a share link (member)"
)
def revoke_share(request: HttpRequest, run_id: Id, share_id: Id) -> Status[None]:
    """The link stops working at once; it stays listed as revoked."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    if not revoke_share_link(run, share_id):  # open sockets of the link close too
        raise NotFound(f"run {run.pk} has no share link {share_id}")
    return Status(204, None)


def _shared(token: str) -> Run:
    run = ShareLink.run_for_token(token)
    if run is None:
        raise NotFound("this share link does not exist or was revoked")
    return run


@public_router.get("/shared/{token}", response={200: RunOut, **PUBLIC}, summary="A shared run")
def shared_run(request: HttpRequest, token: str) -> dict[str, Any]:
    """The run a share link opens, read-only (the same fields as GET /api/runs/{id})."""
    return serializers.run_out(_shared(token), None)


@public_router.get(
    "/shared/{token}/metrics", response={200: list[MetricNameOut], **PUBLIC}, summary="Shared: metric names"
)
def shared_metrics(request: HttpRequest, token: str) -> list[dict[str, Any]]:
    return selectors.metric_names(_shared(token))


@public_router.get(
    "/shared/{token}/metrics/series", response={200: SeriesSetOut, **PUBLIC}, summary="Shared: metric series"
)
def shared_series(request: HttpRequest, token: str, params: Query[SeriesQuery]) -> HttpResponse:
    """As GET /api/runs/{id}/metrics/series (the same JSON writer)."""
    return series_json(series_response(_shared(token), params))


@public_router.get(
    "/shared/{token}/metrics.csv", response=PUBLIC, summary="Shared: metrics as CSV", openapi_extra=CSV_DOC
)
def shared_csv(request: HttpRequest, token: str, params: Query[CsvQuery]) -> StreamingHttpResponse:
    return csv_response(request, _shared(token), params)


@public_router.get("/shared/{token}/samples", response={200: SamplePage, **PUBLIC}, summary="Shared: samples")
def shared_samples(request: HttpRequest, token: str, params: Query[SampleQuery]) -> dict[str, Any]:
    """As GET /api/runs/{id}/samples."""
    return samples_response(_shared(token), params)


@public_router.get(
    "/shared/{token}/samples/steps",
    response={200: list[SampleStepOut], **PUBLIC},
    summary="Shared: sample steps",
)
def shared_sample_steps(request: HttpRequest, token: str) -> list[dict[str, Any]]:
    return selectors.sample_steps(_shared(token))
