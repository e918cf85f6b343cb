"""External runs: create one for a script that trains itself, and renew its ingest token.

The script authenticates with a personal API token (``Authorization: Bearer trb_...``) and must
be allowed to launch in the project (member). The answer carries the run's page URL and what the
script needs to ship its events: the ingest socket's URL, built from the request (``ws://`` or
``wss://`` as the request came, so it works behind the same proxy), and an ingest token
(``webapp.runs.external``).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema, Status
from ninja.errors import ValidationError
from pydantic import Field, field_validator

from tributary.shipper import ingest_url
from webapp.api.routers import WRITE, Id
from webapp.api.schemas import ErrorOut, JsonValue, Name, Text, clean_tags
from webapp.runs.external import ExternalRefused, create_external_run, token_for
from webapp.runs.models import Run
from webapp.teams.access import NotFound, memberships_of, project_for, run_for
from webapp.teams.choices import Role
from webapp.teams.models import Project

router = Router(tags=["external runs"])

REFUSED: dict[int, Any] = {409: ErrorOut}


class ExternalRunIn(Schema):
    project: Text = Field(
        ...,
        min_length=1,
        max_length=201,
        description="The project's slug, or 'team-slug/project-slug' when the slug is in several of your teams.",
    )
    name: Name = Field(..., max_length=200)
    config: JsonValue = Field(
        default_factory=dict,
        description="The script's own settings (free-form: stored and shown, never validated or executed); "
        "at most 32 levels deep and 256 KiB as JSON.",
        json_schema_extra={"type": "object"},
    )
    tags: list[Text] = Field(default_factory=list)
    client_id: uuid.UUID | None = Field(
        None,
        description="A UUID the script keeps: creating again with the same one in the same project returns "
        "the same run (200) with a fresh token.",
    )

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        return clean_tags(value)


class IngestOut(Schema):
    ingest_url: str = Field(description="The run's ingest socket: ws(s)://<host>/ws/ingest/<id>/.")
    ingest_token: str = Field(
        description="Send as 'Authorization: Bearer <token>' on the ingest socket; it expires (renewed "
        "over the socket while the run is not final)."
    )


class ExternalRunOut(IngestOut):
    id: int
    url: str = Field(description="The run's page.")


def _project(user: Any, ref: str) -> Project:
    """The project ``ref`` names among the caller's teams (``slug`` or ``team/slug``), with the
    member role; a 404 when none, a 422 naming ``project`` when the slug is ambiguous."""
    team_slug, _, slug = ref.strip().rpartition("/")
    teams = memberships_of(user).values_list("team_id", flat=True)
    found = Project.objects.filter(team_id__in=teams, slug=slug)
    if team_slug:
        found = found.filter(team__slug=team_slug)
    matches = list(found.select_related("team").order_by("team__slug")[:5])
    if not matches:
        raise NotFound(
            f"project {ref!r} not found in your teams (give its slug, or 'team-slug/project-slug')"
        )
    if len(matches) > 1:
        choices = ", ".join(f"{p.team.slug}/{p.slug}" for p in matches)
        msg = f"{ref!r} names a project in several of your teams: give one of {choices}"
        raise ValidationError([{"type": "value_error", "loc": ["body", "payload", "project"], "msg": msg}])
    return project_for(user, matches[0].pk, Role.MEMBER)


def _ingest(request: HttpRequest, run: Run) -> dict[str, str]:
    return {"ingest_url": ingest_url(request.build_absolute_uri("/"), run.pk), "ingest_token": token_for(run)}


@router.post(
    "/runs/external",
    response={200: ExternalRunOut, 201: ExternalRunOut, **WRITE, **REFUSED},
    summary="Create an external run, trained by your own script (member)",
)
def create_external(request: HttpRequest, payload: ExternalRunIn) -> Status[dict[str, Any]]:
    """A run with no worker: your script trains and ships its events to ``ingest_url`` with
    ``ingest_token`` (the client library does both). 201 when created; 200 with the same run
    and a fresh token when ``client_id`` already names a run of the project. 409 when the project
    is archived. The config is stored as given (bounded), never validated or executed."""
    project = _project(request.auth, payload.project)
    run, created = create_external_run(
        project,
        request.auth,
        name=payload.name,
        config=payload.config,
        tags=payload.tags,
        client_id=payload.client_id,
    )
    ingest = _ingest(request, run)
    body = {"id": run.pk, "url": request.build_absolute_uri(run.get_absolute_url()), **ingest}
    return Status(201 if created else 200, body)


@router.post(
    "/runs/{run_id}/ingest-token",
    response={200: IngestOut, **WRITE, **REFUSED},
    summary="A fresh ingest token for an external run (member)",
)
def renew_ingest_token(request: HttpRequest, run_id: Id) -> Status[dict[str, Any]]:
    """For a script that lost its token (a restart with its offline log, ``sync``). 409 for an
    engine run: its worker holds the token its queue message carried."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    try:
        return Status(200, _ingest(request, run))
    except ExternalRefused as exc:
        return Status(409, {"detail": str(exc)})
