"""What the runs table reads instead of a run's metric points: one summary row per run and
metric name, kept at ingest (``webapp.analysis.summaries``), and each user's chosen columns.

A table sorted or filtered by "the last ``reward/mean``" of 2,000 runs must not read their
millions of points per request (issue 18): the summaries are updated inside ingest's transaction,
so they move with the run's cursor and a rolled-back batch leaves none behind.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class MetricSummary(models.Model):
    """A run's metric over its history (the points not superseded by a rewind): the value at the
    last step, the smallest and largest value, and how many points."""

    # No index of its own: the unique index (run, name) serves every lookup by run (a second
    # index on run alone tempted PostgreSQL's planner into probing it and filtering by name).
    run = models.ForeignKey(
        "runs.Run", on_delete=models.CASCADE, related_name="metric_summaries", db_index=False
    )
    name = models.CharField(max_length=200)
    last = models.FloatField(help_text="The value at the highest step.")
    last_step = models.IntegerField()
    min = models.FloatField()
    max = models.FloatField()
    count = models.PositiveIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="summary_one_per_run_name")]
        # The unique index (run, name) serves the table's joins; this one the project's metric
        # names (the column picker) and "does any run of the project log this metric".
        indexes = [models.Index(fields=["name", "run"], name="summary_name_run")]

    def __str__(self) -> str:
        return f"{self.name}: last {self.last}@{self.last_step}, [{self.min}, {self.max}] of {self.count}"


class TableView(models.Model):
    """The columns and grouping a user last chose for a project's runs table: the table's
    default when its URL names none (a URL with columns always wins, and becomes the saved set)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey("teams.Project", on_delete=models.CASCADE, related_name="+")
    columns = models.JSONField(
        default=list, help_text='Column specs: ["config:rollout.n", "last:reward/mean"].'
    )
    group_by = models.JSONField(default=list, help_text="Config key paths the runs are grouped by.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "project"], name="table_view_one_per_user")]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.project_id}: {self.columns} by {self.group_by}"
