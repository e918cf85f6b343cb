"""Health alerts: what fired on a run, and the rules' settings of a project and of a run."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router
from ninja.errors import ValidationError

from webapp.alerts import webhooks
from webapp.alerts.models import Alert, ProjectAlertSettings
from webapp.alerts.rules import RULES, SettingsError, effective, validate_settings
from webapp.api.routers import READ, WRITE, Id
from webapp.api.schemas import AlertOut, AlertSettingsOut, ProjectAlertSettingsIn, RunAlertOverridesIn
from webapp.runs.models import Run
from webapp.teams.access import project_for, role_in, run_for
from webapp.teams.choices import Role

router = Router(tags=["alerts"])

CATALOGUE = [
    {"name": r.name, "title": r.title, "params": {k: p.default for k, p in r.params.items()}}
    for r in RULES.values()
]


def _refused(field: str, message: str) -> ValidationError:
    return ValidationError(
        [{"type": "value_error", "loc": ["body", "payload", *field.split(".")], "msg": message}]
    )


def _rules(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    try:
        return validate_settings(data, "rules")
    except SettingsError as exc:
        raise _refused(exc.field, str(exc)) from None


def _settings_out(project_rules: dict, run_rules: dict | None, webhook: str | None) -> dict[str, Any]:
    layers = [project_rules] + ([run_rules] if run_rules is not None else [])
    return {
        "rules": run_rules if run_rules is not None else project_rules,
        "effective": effective(*layers),
        "webhook_url": webhook,
        "catalogue": CATALOGUE,
    }


@router.get(
    "/runs/{run_id}/alerts", response={200: list[AlertOut], **READ}, summary="A run's alerts (viewer)"
)
def run_alerts(request: HttpRequest, run_id: Id) -> list[dict[str, Any]]:
    """Every alert that fired on the run, by step."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    return [a.item() for a in Alert.objects.filter(run=run).order_by("step", "id")]


@router.get(
    "/projects/{project_id}/alert-settings",
    response={200: AlertSettingsOut, **READ},
    summary="A project's alert settings (viewer)",
)
def project_alert_settings(request: HttpRequest, project_id: Id) -> dict[str, Any]:
    """The project's rule settings, what applies with the defaults, and (for admins) its webhook."""
    project = project_for(request.auth, project_id, Role.VIEWER)
    row = ProjectAlertSettings.objects.filter(project=project).first()
    is_admin = (role_in(request.auth, project.team_id) or Role.VIEWER) == Role.ADMIN
    webhook = (row.webhook_url if row else "") if is_admin else None
    return _settings_out(row.rules if row else {}, None, webhook)


@router.put(
    "/projects/{project_id}/alert-settings",
    response={200: AlertSettingsOut, **WRITE},
    summary="Set a project's alert settings (admin)",
)
def put_project_alert_settings(
    request: HttpRequest, project_id: Id, payload: ProjectAlertSettingsIn
) -> dict[str, Any]:
    """Replaces the project's settings. The webhook must be an http(s) URL whose host resolves to
    public addresses (``TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE`` admits private ones)."""
    project = project_for(request.auth, project_id, Role.ADMIN)
    rules = _rules(payload.rules)
    url = payload.webhook_url.strip()
    if url:
        try:
            webhooks.check_setting(url)
        except webhooks.WebhookRefused as exc:
            raise _refused("webhook_url", str(exc)) from None
    ProjectAlertSettings.objects.update_or_create(
        project=project, defaults={"rules": rules, "webhook_url": url}
    )
    return _settings_out(rules, None, url)


@router.get(
    "/runs/{run_id}/alert-settings",
    response={200: AlertSettingsOut, **READ},
    summary="A run's alert settings (viewer)",
)
def run_alert_settings(request: HttpRequest, run_id: Id) -> dict[str, Any]:
    """The run's overrides and what applies to it (defaults, then the project's, then the run's)."""
    run = run_for(request.auth, run_id, Role.VIEWER)
    project = ProjectAlertSettings.objects.filter(project_id=run.project_id).first()
    return _settings_out(project.rules if project else {}, run.alert_overrides, None)


@router.put(
    "/runs/{run_id}/alert-settings",
    response={200: AlertSettingsOut, **WRITE},
    summary="Override a run's alerts (member)",
)
def put_run_alert_settings(request: HttpRequest, run_id: Id, payload: RunAlertOverridesIn) -> dict[str, Any]:
    """Replaces the run's overrides; they apply from the next metrics the run ships."""
    run = run_for(request.auth, run_id, Role.MEMBER)
    rules = _rules(payload.rules)
    Run.objects.filter(pk=run.pk).update(alert_overrides=rules)
    project = ProjectAlertSettings.objects.filter(project_id=run.project_id).first()
    return _settings_out(project.rules if project else {}, rules, None)
