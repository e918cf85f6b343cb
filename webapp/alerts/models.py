"""Health alerts: what fired on a run, and the settings and rule state behind it."""

from __future__ import annotations

from django.db import models

from webapp.runs.models import Run
from webapp.teams.models import Project


class Alert(models.Model):
    """One firing of a rule (``webapp.alerts.rules``) on a run, at the step where it started to hold."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alerts")
    rule = models.CharField(max_length=32)
    step = models.IntegerField()
    seq = models.BigIntegerField(help_text="The metrics event that fired it.")
    metric = models.CharField(max_length=200, blank=True)
    value = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    message = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["step", "id"]
        constraints = [
            # A rule fires once per step at most: storing is idempotent like the rest of ingest.
            models.UniqueConstraint(fields=["run", "rule", "step"], name="alert_one_per_run_rule_step")
        ]

    def __str__(self) -> str:
        return f"{self.rule} on run {self.run_id} at step {self.step}"

    def item(self) -> dict[str, object]:
        """The alert as the API and the live socket send it."""
        return {
            "id": self.pk,
            "rule": self.rule,
            "step": self.step,
            "metric": self.metric,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
            "time": self.created_at.timestamp() if self.created_at else None,
        }


class ProjectAlertSettings(models.Model):
    """A project's defaults for every run in it: rule parameters over the built-in ones, and a
    webhook called with each alert."""

    project = models.OneToOneField(
        Project, on_delete=models.CASCADE, primary_key=True, related_name="alert_settings"
    )
    rules = models.JSONField(default=dict, blank=True, help_text="{rule: {enabled, parameter: value}}")
    webhook_url = models.URLField(max_length=500, blank=True)
