"""External runs: create one for a script that trains itself, and renew its ingest token.

The script authenticates with a personal API token (``Authorization: Bearer trb_...``) and must
be allowed to launch in the project (member). The answer carries the run's page URL and what the
script needs to ship its events: the ingest socket's URL, built from the request (``ws://`` or
``wss://`` as the request came, so it works behind the same proxy), and an ingest token
(``webapp.runs.external``).

A script that gives a ``claim`` (with its ``host`` and ``pid``) holds the run: while another
script holds it, both calls answer 409 with ``held_by`` (where that script reports from) and no
token, so nothing of this script is stored (``webapp.runs.external.hold_run``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema, Status
from ninja.errors import HttpError, ValidationError
from pydantic import Field, field_validator
from pydantic import ValidationError as PydanticError

from tributary.protocol import CLAIM_MAX_CHARS
from tributary.shipper import ingest_url
from webapp.api.routers import WRITE, Id
from webapp.api.schemas import ErrorOut, JsonValue, Name, Text, clean_tags
from webapp.inputs import INT_MAX
from webapp.runs.external import ExternalRefused, ScriptHeld, create_external_run, hold_run, token_for
from webapp.runs.models import Run
from webapp.teams.access import NotFound, memberships_of, project_for, run_for
from webapp.teams.choices import Role
from webapp.teams.models import Project

router = Router(tags=["external runs"])


class RefusedOut(ErrorOut):
    held_by: str | None = Field(
        None,
        description="Set when another script holds the run (the same client_id from another copy of the "
        "script): the host it reports from. Start this script as a new run.",
    )


REFUSED: dict[int, Any] = {409: RefusedOut}


class ScriptIn(Schema):
    """Who asks, for a script that holds its run (the client library sends all three)."""

    claim: str | None = Field(
        None,
        min_length=1,
        max_length=CLAIM_MAX_CHARS,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="The script's claim, '<lineage>.<place>' (tributary.protocol.script_claim): while another "
        "claim holds the run, 409 and no token. Without one, no check (clients of before).",
    )
    host: Text = Field("", max_length=255, description="The script's host, named in a refusal to another.")
    pid: int | None = Field(None, ge=1, le=INT_MAX, description="The script's process id.")


class ExternalRunIn(ScriptIn):
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


def _ingest(request: HttpRequest, run: Run, script: ScriptIn | None = None) -> dict[str, str]:
    """The run's socket and a fresh token; with a claim, once its script holds the run
    (``ScriptHeld`` else: no token)."""
    token = token_for(run)
    if script is not None and script.claim:
        hold_run(run.pk, script.claim, script.host, script.pid)
    return {"ingest_url": ingest_url(request.build_absolute_uri("/"), run.pk), "ingest_token": token}


def _refused(exc: ExternalRefused) -> Status[dict[str, Any]]:
    held_by = exc.held_by if isinstance(exc, ScriptHeld) else None
    return Status(409, {"detail": str(exc), "held_by": held_by})


@router.post(
    "/runs/external",
    response={200: ExternalRunOut, 201: ExternalRunOut, **WRITE, **REFUSED},
    summary="Create an external run, trained by your own script (member)",
)
def create_external(request: HttpRequest, payload: ExternalRunIn) -> Status[dict[str, Any]]:
    """A run with no worker: your script trains and ships its events to ``ingest_url`` with
    ``ingest_token`` (the client library does both). 201 when created; 200 with the same run
    and a fresh token when ``client_id`` already names a run of the project. 409 when the project
    is archived, or when another script holds that run (``claim``; ``held_by`` says where it
    reports from). The config is stored as given (bounded), never validated or executed."""
    project = _project(request.auth, payload.project)
    run, created = create_external_run(
        project,
        request.auth,
        name=payload.name,
        config=payload.config,
        tags=payload.tags,
        client_id=payload.client_id,
    )
    try:
        ingest = _ingest(request, run, payload)
    except ExternalRefused as exc:
        return _refused(exc)
    body = {"id": run.pk, "url": request.build_absolute_uri(run.get_absolute_url()), **ingest}
    return Status(201 if created else 200, body)


def _script_body(request: HttpRequest) -> ScriptIn | None:
    """The optional JSON body of a token renewal: clients of before claims send ``{}`` or no body
    at all (a form post), so ninja's body parameter, which parses any body as JSON, is not used."""
    if request.content_type != "application/json" or not request.body.strip():
        return None
    try:
        data = json.loads(request.body)
    except ValueError as exc:
        raise HttpError(400, f"the body is not JSON: {exc}") from None
    try:
        return ScriptIn.model_validate(data)
    except PydanticError as exc:
        raise ValidationError(
            [
                {"type": e["type"], "loc": ["body", "payload", *e["loc"]], "msg": e["msg"]}
                for e in exc.errors()
            ]
        ) from None


@router.post(
    "/runs/{run_id}/ingest-token",
    response={200: IngestOut, **WRITE, **REFUSED},
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": ScriptIn.model_json_schema()}},
        }
    },
    summary="A fresh ingest token for an external run (member)",
)
def renew_ingest_token(request: HttpRequest, run_id: Id) -> Status[dict[str, Any]]:
    """For a script that lost its token (a restart with its offline log, ``sync``). 409 for an
    engine run: its worker holds the token its queue message carried; 409 with ``held_by`` when
    another script holds the run (the body's ``claim``; no body: no check, as before claims)."""
    script = _script_body(request)
    run = run_for(request.auth, run_id, Role.MEMBER)
    try:
        return Status(200, _ingest(request, run, script))
    except ExternalRefused as exc:
        return _refused(exc)
