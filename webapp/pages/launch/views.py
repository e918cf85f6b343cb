"""The new-run page: a form generated from the engine's schema, a YAML view of the same config.

One view serves the page and its editor. The page posts (no JavaScript needed) to review,
launch or export; the editor's buttons post through htmx to ``…/new/editor/`` and get the
editor back (form <-> YAML, import a file, add or remove a reward row, reset a field). The
config travels in the request either as the generated form's fields (``_mode=form``) or as
YAML (``_mode=yaml``).

Every value is compared with a baseline: the preset the page started from, or the run it
clones (``_baseline``). The form marks the fields that differ (``layout.py``), and the review
step (``_action=review``) lists the differences of the validated config, which is what a launch
stores (``review.py``).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import yaml
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.text import slugify
from django.views.decorators.http import require_http_methods, require_POST

from engine.config import PRESETS, ConfigError, deep_merge, json_schema, load_yaml, resolve_preset
from webapp.inputs import parse_id
from webapp.pages.launch import layout, review, schema_form
from webapp.runs import placement
from webapp.runs.choices import ParentKind
from webapp.runs.models import Run
from webapp.runs.placement import AUTO
from webapp.runs.queueing import reward_policy_for
from webapp.runs.services import (
    QUEUE_CHARS,
    ProjectArchived,
    RunConfigInvalid,
    create_run,
    validate_run_config,
)
from webapp.teams import access
from webapp.teams.choices import Role
from webapp.teams.models import Project

PRESET_LABELS = {
    "grpo": "GRPO",
    "dapo": "DAPO",
    "dr_grpo": "Dr. GRPO",
    "rloo": "RLOO",
    "reinforce_pp": "REINFORCE++",
    "gspo": "GSPO",
    "cispo": "CISPO",
}
DEFAULT_PRESET = "grpo"
MAX_UPLOAD_BYTES = 1_000_000
LAUNCH_FIELDS = ("queue", "tags", "notes")
LAUNCH_LABELS = {"queue": "Queue", "tags": "Tags", "notes": "Notes"}  # new.html's labels of LAUNCH_FIELDS
OPEN_FIELD = "_open"  # hidden input: ids of the sections the user opened, kept across re-renders
SECTION_ID = re.compile(r"f-[a-z_]{1,40}")  # what OPEN_FIELD may hold (it is echoed back into the page)
MAX_OPEN = 32


@functools.cache
def _schema() -> dict[str, Any]:
    return json_schema()


@functools.cache
def _defaults() -> dict[str, Any]:
    return validate_run_config({})


@functools.cache
def _preset_config(name: str) -> dict[str, Any]:
    return validate_run_config({"preset": name, "name": name.replace("_", "-")})


def _complete(values: dict[str, Any]) -> dict[str, Any]:
    """What the engine would see: the preset underneath, then every default filled in."""
    return deep_merge(_defaults(), resolve_preset(values))


def _baseline(launch: dict[str, Any]) -> dict[str, Any]:
    """What the values are compared with: the cloned run's stored config, else the preset's
    (validated as a launch of it unchanged would store it), else the defaults."""
    run = launch["from_run"]
    if run is not None:
        return {"config": run.config, "label": f"run {run.name}"}
    preset = launch["preset"]
    if preset in PRESETS:
        return {"config": _preset_config(preset), "label": f"preset {PRESET_LABELS.get(preset, preset)}"}
    return {"config": _defaults(), "label": "the defaults"}


class _Editor:
    """The state of the config editor of one request."""

    def __init__(
        self,
        mode: str = "form",
        config: dict[str, Any] | None = None,
        text: str = "",
        baseline: dict[str, Any] | None = None,
        open_ids: set[str] | None = None,
    ) -> None:
        self.mode = mode
        self.config = config if config is not None else {}
        self.text = text
        self.yaml_error = ""
        self.problems: list[tuple[str, str]] = []
        self.baseline = baseline if baseline is not None else {"config": _defaults(), "label": "the defaults"}
        self.open_ids = open_ids or set()

    def context(self, launch_errors: dict[str, str] | None = None) -> dict[str, Any]:
        """The editor's template context; its error summary lists every problem the page shows
        (``launch_errors``: those of the launch fields below the editor, by field name)."""
        ctx: dict[str, Any] = {
            "mode": self.mode,
            "yaml_text": self.text,
            "yaml_error": self.yaml_error,
            "baseline_label": self.baseline["label"],
            "open_ids": " ".join(sorted(self.open_ids)),
        }
        if self.mode == "form":
            form = schema_form.build_form(_schema(), self.config)
            layout.mark_changes(form, schema_form.build_form(_schema(), self.baseline["config"]))
            general = schema_form.attach_errors(form, self.problems)
            layout.arrange(form, self.open_ids)
            ctx.update(form=form, general_errors=general, field_errors=schema_form.field_errors(form))
        else:
            ctx.update(
                general_errors=[
                    {"path": schema_form.normalise_path(p) or "config", "message": m}
                    for p, m in self.problems
                ],
                field_errors=[],
            )
        ctx["launch_errors"] = [
            {"id": f"f-{name}", "label": LAUNCH_LABELS.get(name, name), "path": name, "message": message}
            for name, message in (launch_errors or {}).items()
        ]
        # One per line of the summary: the count a person reads above the list is the list's length.
        ctx["error_count"] = (
            len(ctx["general_errors"])
            + len(ctx["field_errors"])
            + len(ctx["launch_errors"])
            + (1 if self.yaml_error else 0)
        )
        return ctx


def _project(request: HttpRequest, project_id: int) -> Project:
    try:
        return access.project_for(request.user, project_id, Role.MEMBER)
    except access.NotFound:
        raise Http404("project not found") from None


def _source_run(request: HttpRequest, run_id: str) -> Run:
    parsed = parse_id(run_id)
    if parsed is None:
        raise Http404(f"{run_id!r} is not a run id")
    try:
        run = access.run_for(request.user, parsed)
    except access.NotFound:
        raise Http404("run not found") from None
    if run.is_external:  # its config is its script's, not an engine config: nothing to fork
        raise Http404(f"run {run.pk} is an external run: only engine runs can be forked")
    return run


def _initial(request: HttpRequest) -> tuple[_Editor, dict[str, Any]]:
    """The editor and launch fields of a GET: a preset, or a clone of a run."""
    launch: dict[str, Any] = {"queue": AUTO, "tags": "", "notes": "", "from_run": None, "preset": ""}
    source = request.GET.get("from")
    if source:
        run = _source_run(request, source)
        config = copy.deepcopy(run.config)
        config["name"] = f"{run.name}-fork"[:200]
        launch.update(queue=run.queue, tags=", ".join(run.tags or []), from_run=run)
        return _Editor("form", _complete(config), baseline=_baseline(launch)), launch
    preset = request.GET.get("preset") or DEFAULT_PRESET
    if preset not in PRESETS:
        raise Http404(f"unknown preset {preset!r}")
    launch["preset"] = preset
    return _Editor("form", copy.deepcopy(_preset_config(preset)), baseline=_baseline(launch)), launch


def _posted(request: HttpRequest) -> tuple[_Editor, dict[str, Any]]:
    """The editor state and launch fields of a POST."""
    data = request.POST
    launch: dict[str, Any] = {
        "queue": data.get("queue", AUTO),
        "tags": data.get("tags", ""),
        "notes": data.get("notes", ""),
        "from_run": None,
        "preset": data.get("_preset", ""),
    }
    if data.get("_from"):
        launch["from_run"] = _source_run(request, data["_from"])
    baseline = _baseline(launch)
    open_ids = {i for i in data.get(OPEN_FIELD, "").split()[:MAX_OPEN] if SECTION_ID.fullmatch(i)}
    if data.get("_mode") == "yaml":
        return _Editor("yaml", text=data.get("config_yaml", ""), baseline=baseline, open_ids=open_ids), launch
    config, problems = schema_form.parse_form(_schema(), data)
    editor = _Editor("form", config, baseline=baseline, open_ids=open_ids)
    editor.problems = problems
    return editor, launch


def _load_yaml_text(editor: _Editor) -> dict[str, Any] | None:
    """The mapping the YAML text holds, or None with ``yaml_error`` set."""
    try:
        value = load_yaml(editor.text)
    except yaml.YAMLError as exc:
        editor.yaml_error = f"YAML syntax error at {schema_form.yaml_error_text(exc)}"
        return None
    if value is None:
        value = {}
    if not isinstance(value, dict):
        editor.yaml_error = (
            f"The top level must be a mapping of sections (model:, rollout:, ...), got {type(value).__name__}"
        )
        return None
    return value


def _to_form(editor: _Editor) -> None:
    value = _load_yaml_text(editor)
    if value is None:
        return
    try:
        editor.config = _complete(value)
    except ConfigError as exc:
        editor.problems = list(exc.problems)
        editor.config = value
    editor.mode = "form"


def _to_yaml(editor: _Editor) -> None:
    editor.text = schema_form.to_yaml(editor.config)
    editor.mode = "yaml"


def _import(request: HttpRequest, editor: _Editor) -> None:
    upload = request.FILES.get("config_file")
    editor.mode = "yaml"
    if upload is None:
        editor.yaml_error = "Choose a YAML file to import first."
        return
    if upload.size and upload.size > MAX_UPLOAD_BYTES:
        editor.yaml_error = (
            f"{upload.name} is over {MAX_UPLOAD_BYTES // 1000} kB: a config file is much smaller"
        )
        return
    try:
        editor.text = upload.read().decode("utf-8")
    except UnicodeDecodeError:
        editor.yaml_error = f"{upload.name} is not a UTF-8 text file"
        return
    _load_yaml_text(editor)


def _apply_action(request: HttpRequest, editor: _Editor, action: str) -> None:
    if action == "to_yaml" and editor.mode == "form":
        _to_yaml(editor)
    elif action == "to_form" and editor.mode == "yaml":
        _to_form(editor)
    elif action == "import":
        _import(request, editor)
    elif action.startswith("add:") and editor.mode == "form":
        path = action.removeprefix("add:")
        schema_form.add_row(editor.config, path, schema_form.row_template(_schema(), path))
    elif action.startswith("remove:") and editor.mode == "form":
        schema_form.remove_row(editor.config, action.removeprefix("remove:"))
    elif action.startswith("reset:") and editor.mode == "form":
        schema_form.reset_value(editor.config, editor.baseline["config"], action.removeprefix("reset:"))


def _config_of(editor: _Editor) -> dict[str, Any] | None:
    if editor.mode == "yaml":
        return _load_yaml_text(editor)
    return editor.config


def _page(
    request: HttpRequest,
    project: Project,
    editor: _Editor,
    launch: dict[str, Any],
    status: int = 200,
    **extra: Any,
) -> HttpResponse:
    context = {
        "project": project,
        "archived": str(ProjectArchived(project)) if project.archived_at is not None else "",
        "editor": editor.context(extra.get("launch_errors")),
        "launch": launch,
        "presets": [{"name": n, "label": PRESET_LABELS.get(n, n)} for n in PRESETS],
        # The queues online workers serve, offered beside "auto" (any name may be typed).
        "queues": sorted({q for w in placement.live_workers() for q in w.capabilities.queues}),
        **extra,
    }
    return render(request, "pages/launch/new.html", context, status=status)


def _editor_response(request: HttpRequest, project: Project, editor: _Editor) -> HttpResponse:
    return render(request, "pages/launch/_editor.html", {"project": project, "editor": editor.context()})


def _tags(text: str) -> list[str]:
    out: list[str] = []
    for tag in text.replace("\n", ",").split(","):
        tag = tag.strip()
        if tag and tag not in out:
            out.append(tag[:64])
    return out


def _validated(
    request: HttpRequest, project: Project, editor: _Editor, launch: dict[str, Any]
) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The config as a launch would store it, or None with every problem put where the page shows it."""
    config = _config_of(editor)
    launch_errors: dict[str, str] = {}
    queue = (launch["queue"] or AUTO).strip().lower()
    if len(queue) > 64 or set(queue) - QUEUE_CHARS:
        launch_errors["queue"] = (
            f"{queue!r} is not a queue name: use letters, digits, '-', '_' or '.' (e.g. cpu, gpu)"
        )
    if config is None or editor.problems:
        return None, launch_errors
    try:
        validated = validate_run_config(config, reward_policy_for(project, request.user))
    except RunConfigInvalid as exc:  # checked even with a bad queue, so every problem shows at once
        editor.problems.extend(exc.problems)
        return None, launch_errors
    return (None if launch_errors else validated), launch_errors


def _review(launch: dict[str, Any], editor: _Editor, validated: dict[str, Any]) -> dict[str, Any]:
    """The review step's context: the differences from the baseline and the digest a launch checks."""
    queue, tags, notes = (launch["queue"] or AUTO).strip().lower(), _tags(launch["tags"]), launch["notes"]
    return {
        "rows": review.config_diff(validated, editor.baseline["config"]),
        "baseline_label": editor.baseline["label"],
        "queue": queue,
        "tags": tags,
        "digest": review.digest(validated, queue, tags, notes),
        "stale": False,
    }


def _launch(
    request: HttpRequest, project: Project, editor: _Editor, launch: dict[str, Any], *, action: str
) -> HttpResponse:
    """``review``: the review step (or the problems); ``launch``: create the run, unless the values
    differ from the review the form was launched from, which is then shown again."""
    validated, launch_errors = _validated(request, project, editor, launch)
    if validated is None:
        return _page(request, project, editor, launch, status=422, launch_errors=launch_errors)
    checked = _review(launch, editor, validated)
    reviewed = request.POST.get("_reviewed", "")
    if action == "review" or (reviewed and reviewed != checked["digest"]):
        checked["stale"] = action != "review"
        status = 409 if checked["stale"] else 200
        return _page(request, project, editor, launch, status=status, review=checked)
    config = _config_of(editor)
    parent = launch["from_run"]
    try:
        run = create_run(
            project,
            request.user,
            config,
            name=str(validated.get("name") or ""),
            queue=launch["queue"] or AUTO,
            tags=_tags(launch["tags"]),
            notes=launch["notes"],
            parent=parent,
            parent_kind=ParentKind.FORK if parent else "",
        )
    except RunConfigInvalid as exc:
        for path, message in exc.problems:
            if path in LAUNCH_FIELDS:
                launch_errors[path] = message
            else:
                editor.problems.append((path, message))
        return _page(request, project, editor, launch, status=422, launch_errors=launch_errors)
    return redirect(run)


def _export(editor: _Editor) -> HttpResponse:
    if editor.mode == "yaml":
        text = editor.text
        name = "config"
        loaded = _load_yaml_text(editor)
        if loaded:
            name = str(loaded.get("name") or name)
    else:
        text = schema_form.to_yaml(editor.config)
        name = str(editor.config.get("name") or "config")
    response = HttpResponse(text, content_type="application/x-yaml; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{slugify(name) or "config"}.yaml"'
    return response


@login_required
@require_http_methods(["GET", "POST"])
def new_run(request: HttpRequest, project_id: int) -> HttpResponse:
    try:
        project = _project(request, project_id)
    except access.Forbidden as exc:
        raise PermissionDenied(str(exc)) from None
    if request.method == "GET":
        editor, launch = _initial(request)
        return _page(request, project, editor, launch)
    editor, launch = _posted(request)
    action = request.POST.get("_action", "launch")
    if action == "export":
        return _export(editor)
    if action in ("launch", "review"):
        if project.archived_at is not None:  # the form says so; a stale or hand-made POST is refused
            return _page(request, project, editor, launch, status=409)
        return _launch(request, project, editor, launch, action=action)
    _apply_action(request, editor, action)  # the page without JavaScript: same editor actions
    return _page(request, project, editor, launch)


@login_required
@require_POST
def editor(request: HttpRequest, project_id: int) -> HttpResponse:
    """The editor partial after an htmx action (to_yaml, to_form, import, add:..., remove:...)."""
    try:
        project = _project(request, project_id)
    except access.Forbidden as exc:
        raise PermissionDenied(str(exc)) from None
    state, _launch_fields = _posted(request)
    _apply_action(request, state, request.POST.get("_action", ""))
    return _editor_response(request, project, state)
