"""Request and response bodies of the API (pydantic through ninja's ``Schema``).

Every text field of a request body is ``Text`` and every free-form JSON value is ``JsonValue``:
a NUL character or a lone surrogate (``"\\ud800"`` is valid JSON, but not Unicode text) is a
422 naming the field, where PostgreSQL would fail the insert with a 500. Ids are ``Id``, within
the ``bigint`` range of the columns they are looked up in (``webapp.inputs``).
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from ninja import Schema
from pydantic import AfterValidator, Field, field_validator

from webapp.inputs import BIGINT_MAX, json_problem, text_problem

MAX_TAGS = 32
MAX_TAG_LENGTH = 50
SLUG = re.compile(r"^[a-z0-9]+(?:[-_][a-z0-9]+)*$")


def clean_tags(tags: list[str]) -> list[str]:
    """Tags stripped and de-duplicated (first one wins), each 1-50 characters, at most 32."""
    out: list[str] = []
    for tag in tags:
        tag = tag.strip()
        if not tag or len(tag) > MAX_TAG_LENGTH:
            raise ValueError(f"each tag must be 1-{MAX_TAG_LENGTH} characters, got {tag!r}")
        if tag not in out:
            out.append(tag)
    if len(out) > MAX_TAGS:
        raise ValueError(f"at most {MAX_TAGS} tags, got {len(out)}")
    return out


def _storable_text(value: str) -> str:
    problem = text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _storable_json(value: Any) -> Any:
    problem = json_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _not_blank(value: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError("must not be blank")
    return value


Text = Annotated[str, AfterValidator(_storable_text)]
# A name: storable text, surrounding blanks stripped, and something left.
Name = Annotated[str, AfterValidator(_storable_text), AfterValidator(_not_blank)]
JsonValue = Annotated[Any, AfterValidator(_storable_json)]
JsonObject = Annotated[dict[str, Any], AfterValidator(_storable_json)]
Id = Annotated[int, Field(ge=1, le=BIGINT_MAX)]


# --- errors ------------------------------------------------------------------------------


class ErrorOut(Schema):
    detail: str = Field(description="What went wrong, and the fix where there is one.")


class FieldError(Schema):
    type: str = Field(description="Kind of problem (pydantic's error type, or 'config_invalid').")
    loc: list[str | int] = Field(
        description="Where: ['body', 'payload', 'config', 'rollout', 'n'], ['query', 'step']."
    )
    msg: str = Field(description="The problem and how to fix it.")


class ValidationErrorOut(Schema):
    detail: list[FieldError]


# --- people, teams, tokens ---------------------------------------------------------------


class TeamOut(Schema):
    id: int
    name: str
    slug: str
    role: str | None = Field(description="The caller's role in the team: viewer, member or admin.")
    created_at: datetime


class MemberOut(Schema):
    user_id: int
    username: str
    role: str


class TeamDetailOut(TeamOut):
    members: list[MemberOut]


class MeOut(Schema):
    id: int
    username: str
    email: str
    first_name: str
    last_name: str
    teams: list[TeamOut]


class TokenIn(Schema):
    name: Name = Field(
        min_length=1, max_length=100, description="What the token is for (a script, a machine)."
    )

    expires_at: datetime | None = Field(
        default=None, description="When the token stops working by itself (ISO 8601); omit: never."
    )


class TokenOut(Schema):
    id: int
    name: str
    prefix: str = Field(description="The token's first characters, to tell tokens apart.")
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    active: bool = Field(description="Neither revoked nor expired: the token works.")


class TokenCreatedOut(TokenOut):
    token: str = Field(description="The token itself. Shown this once: store it now.")


# --- projects ----------------------------------------------------------------------------


class TeamRef(Schema):
    id: int
    name: str
    slug: str


class ProjectIn(Schema):
    name: Name = Field(min_length=1, max_length=100)
    slug: Text = Field("", max_length=100, description="URL name; derived from the name when empty.")
    description: Text = Field("", max_length=10_000)

    @field_validator("slug")
    @classmethod
    def _slug(cls, value: str) -> str:
        value = value.strip().lower()
        if value and not SLUG.match(value):
            raise ValueError("use lowercase letters and digits separated by '-' or '_' (e.g. gsm8k-grpo)")
        return value


class ProjectOut(Schema):
    id: int
    team: TeamRef
    name: str
    slug: str
    description: str
    created_at: datetime
    role: str | None = Field(description="The caller's role in the project's team.")
    run_counts: dict[str, int] = Field(description="Number of runs by status.")
    archived_at: datetime | None = Field(description="When it was archived; null: listed as usual.")


# --- runs --------------------------------------------------------------------------------


class ProjectRef(Schema):
    id: int
    name: str
    slug: str
    team: TeamRef


class RunRef(Schema):
    id: int
    name: str
    status: str


class ChildRef(RunRef):
    kind: str = Field(description="fork or resume")


class CheckpointOut(Schema):
    id: int
    run_id: int
    step: int
    seq: int
    path: str
    bytes: int
    created_at: datetime
    attempt: int = Field(description="The attempt of the run that wrote it.")
    superseded: bool = Field(
        description="A later attempt resumed from an earlier step: off the run's history, not offered to resume from."
    )
    deleted: bool = Field(
        description="The engine deleted its files when it saved a later checkpoint (checkpoint.keep_last, or a "
        "rewind's left branch): not offered to resume from."
    )


class AttemptOut(Schema):
    number: int = Field(description="1 for the launch, then one more for each resume.")
    queued_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    worker_host: str
    from_checkpoint_id: int | None
    from_step: int | None = Field(
        description="The step of the checkpoint it resumed from (null: from the start)."
    )
    first_step: int | None = Field(
        description="Its first logged step: what earlier attempts logged from there on is superseded."
    )
    status: str = Field(
        description="How it ended: succeeded, failed, cancelled or lost (empty while it runs)."
    )
    status_badge: str
    message: str
    first_seq: int | None
    last_seq: int | None


class Permissions(Schema):
    edit: bool = Field(description="Rename, tag, write notes (member).")
    cancel: bool = Field(
        description="Cancel: member, and the run is queued, starting or running (an external run's "
        "second cancel ends it at once: its script did not stop)."
    )
    resume: bool = Field(
        description="Resume (the same run continues) from a checkpoint: member, the run is final and has one "
        "(never for an external run)."
    )
    fork: bool = Field(description="Fork with config changes (member; never for an external run).")
    share: bool = Field(description="Create and revoke share links (member).")


class RunListItem(Schema):
    id: int
    name: str
    project_id: int
    status: str
    status_badge: str
    status_message: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    created_by: str | None = Field(description="Username of the run's creator.")
    queue: str
    origin: str = Field(
        description="engine: a worker runs Tributary's engine; external: the user's own script trains it."
    )
    tags: list[str]
    last_step: int
    parent_id: int | None
    parent_kind: str
    summary: dict[str, Any] = Field(description="Last value of each metric.")
    archived_at: datetime | None = Field(description="When it was archived; null: listed as usual.")


class RunOut(RunListItem):
    project: ProjectRef
    notes: str
    config: dict[str, Any] = Field(description="The full validated engine config.")
    heartbeat_at: datetime | None
    worker_host: str = Field(
        description="The worker's host; for an external run, the host its script reports from."
    )
    client_pid: int | None = Field(description="An external run's script's process id (from its attach).")
    cancel_requested_at: datetime | None
    is_final: bool
    last_seq: int
    parent: RunRef | None
    resume_from: CheckpointOut | None
    children: list[ChildRef]
    attempt_number: int = Field(description="The current attempt's number.")
    attempts: list[AttemptOut] = Field(description="Each time the run was launched or resumed, first first.")
    checkpoint_count: int = Field(
        description="The checkpoints a resume may start from: on the run's history, their files still there."
    )
    role: str | None = Field(description="The caller's role in the run's team (null through a share link).")
    permissions: Permissions


class RunPage(Schema):
    total: int = Field(description="Runs matching the filters, over all pages.")
    limit: int
    offset: int
    items: list[RunListItem]


class RunCreateIn(Schema):
    name: Text = Field("", max_length=200, description="Defaults to the config's name.")
    config: JsonValue = Field(
        ...,
        description="An engine RunConfig as an object (GET /api/schema); 'preset' applies a named preset "
        "underneath the given values.",
        json_schema_extra={"type": "object"},
    )
    queue: Text = Field(
        "auto",
        max_length=64,
        description="Worker queue: cpu, gpu, a named pool, or auto (the queue of an online worker that has "
        "what the config needs: GPUs, backends).",
    )
    tags: list[Text] = Field(default_factory=list)
    notes: Text = Field("", max_length=100_000)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str]) -> list[str]:
        return clean_tags(value)


class RunPatchIn(Schema):
    name: Name | None = Field(None, min_length=1, max_length=200)
    tags: list[Text] | None = None
    notes: Text | None = Field(None, max_length=100_000)

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else clean_tags(value)


class ResumeIn(Schema):
    checkpoint_id: Id | None = Field(None, description="One of the run's checkpoints; default: its latest.")
    queue: Text = Field("", max_length=64, description="Default: the parent's queue.")


class ForkIn(Schema):
    name: Text = Field("", max_length=200, description="Default: '<parent name>-fork'.")
    changes: JsonObject = Field(
        default_factory=dict,
        description="Config changes merged into the parent's config (nested objects merge, anything "
        "else replaces), e.g. {'algorithm': {'clip_ratio_high': 0.28}}.",
    )
    queue: Text = Field("", max_length=64, description="Default: the parent's queue.")


class LogLineOut(Schema):
    seq: int
    level: str
    message: str
    time: datetime


class LogPage(Schema):
    items: list[LogLineOut]
    next_after_seq: int = Field(description="Pass as after_seq to get the lines after these.")
    has_more: bool


class OutputLineOut(Schema):
    offset: int = Field(description="Where the line starts in the run's full log (bytes).")
    level: str
    message: str
    time: datetime


class OutputPage(Schema):
    items: list[OutputLineOut]
    next_after: int = Field(description="Pass as after to get the lines after these.")
    has_more: bool
    dropped: int = Field(
        description="Older lines no longer kept as lines; the full log (output/full) has them."
    )
    full_log_bytes: int = Field(description="Size of the full log the web app holds.")


# --- metrics and samples -----------------------------------------------------------------


class MetricNameOut(Schema):
    name: str
    count: int
    first_step: int
    last_step: int
    last_value: float | None = Field(description="The value at the last step.")


class SeriesOut(Schema):
    name: str
    total: int = Field(description="Points stored in the requested range (before downsampling).")
    downsampled: bool
    bucket_width: float | None = Field(
        description="Steps (x=step) or seconds (x=time) per bucket when downsampled, else null."
    )
    step: list[int] = Field(description="Step of each point; for a bucket, its first step.")
    value: list[float] = Field(description="Value of each point; for a bucket, the mean.")
    time: list[float] = Field(description="Unix time (s) of each point; for a bucket, its first.")
    min: list[float] | None = Field(description="Per-bucket minimum (downsampled only), for a band.")
    max: list[float] | None = Field(description="Per-bucket maximum (downsampled only), for a band.")


class SeriesSetOut(Schema):
    run_id: int
    x: str
    max_points: int
    series: list[SeriesOut]


class SampleOut(Schema):
    id: int
    step: int
    seq: int
    index: int
    prompt: str
    completion: str
    reward: float | None
    advantage: float | None
    length: int
    finish_reason: str
    extra: dict[str, Any]


class SamplePage(Schema):
    total: int
    limit: int
    offset: int
    step: int | None = Field(description="The step shown (resolved when step=latest); null for all steps.")
    items: list[SampleOut]


class SampleStepOut(Schema):
    step: int
    count: int


# --- share links -------------------------------------------------------------------------


class ShareOut(Schema):
    id: int
    run_id: int
    token: str
    path: str = Field(description="The read-only page: /share/<token>/")
    api_path: str = Field(description="The read-only API: /api/shared/<token>")
    created_by: str | None
    created_at: datetime
    revoked_at: datetime | None
    active: bool


class GpuOut(Schema):
    index: int
    name: str
    memory_gb: float
    busy: bool


class WorkerOut(Schema):
    name: str = Field(description="Celery node name.")
    host: str
    queues: list[str] = Field(description="Queues it takes runs from.")
    concurrency: int = Field(description="Runs at a time.")
    cpus: int
    memory_gb: float
    gpus: list[GpuOut]
    backends: dict[str, str] = Field(description="Installed backends and their versions.")
    platform: str
    running: int = Field(description="Runs it holds now (of every team).")
    runs: list[RunRef] = Field(description="The runs it holds that the caller may see.")
    started_at: datetime
    seen_at: datetime


# --- health alerts -------------------------------------------------------------------------


class AlertOut(Schema):
    id: int
    rule: str = Field(description="entropy_collapse, reward_up_eval_down, mismatch_kl, staleness, ...")
    step: int
    metric: str
    value: float | None
    threshold: float | None
    message: str
    time: float | None = Field(description="When it was stored (Unix seconds).")


class AlertRuleOut(Schema):
    name: str
    title: str
    params: dict[str, float] = Field(description="Each parameter's default.")


class AlertSettingsOut(Schema):
    rules: dict[str, dict[str, Any]] = Field(
        description="This level's settings: {rule: {enabled, parameter}}."
    )
    effective: dict[str, dict[str, Any]] = Field(
        description="What applies: defaults, then project, then run."
    )
    webhook_url: str | None = Field(description="The project's webhook (admins only; null for others).")
    catalogue: list[AlertRuleOut]


class ProjectAlertSettingsIn(Schema):
    rules: JsonObject = Field(default_factory=dict, description="{rule: {enabled, parameter: value}}")
    webhook_url: Text = Field(
        "", max_length=500, description="http(s) URL called with each alert; empty for none."
    )


class RunAlertOverridesIn(Schema):
    rules: JsonObject = Field(
        default_factory=dict, description="{rule: {enabled, parameter: value}} over the project's"
    )
