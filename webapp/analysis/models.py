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


class ConfigValue(models.Model):
    """One value of a run's config at one key path (``webapp.analysis.config_keys``): what the
    runs table's config columns, filters, sort, grouping and key picker read, so a request reads
    indexed rows, never each run's config JSON (issue 18: decompressing 2,000 configs of ~2 KB for a
    filter cost 60-200 ms on PostgreSQL, and no JSON index served an equality on any path).

    Written with the run and again when its config changes (``webapp.analysis.config_values``:
    ``Run.save``'s post_save signal, so every way a run is created writes them), backfilled by
    migration 0002. Every path a valid key path reaches is kept, objects too (``leaf`` False)."""

    # No index of its own: the unique index (run, key) serves every lookup by run.
    run = models.ForeignKey(
        "runs.Run", on_delete=models.CASCADE, related_name="config_values", db_index=False
    )
    # The run's project, copied: the key picker lists a project's keys by skipping through an
    # index on (project, key), a probe per distinct key, never a read of every row.
    project = models.ForeignKey("teams.Project", on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.CharField(max_length=520, help_text="The dotted key path: rollout.n")
    leaf = models.BooleanField(help_text="Not an object with keys of its own.")
    kind = models.CharField(max_length=4, help_text="str, num, bool, null, list or dict.")
    text = models.TextField(help_text="The string, or the value's JSON text; the first 1,000 characters.")
    number = models.FloatField(null=True, help_text="A finite number's value: what sorts.")
    digest = models.CharField(max_length=32, help_text="SHA-256 of the kind and canonical JSON: equality.")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "key"], name="config_value_one_per_run_key")]
        indexes = [
            # Equality on a path (a filter, a group's runs, the compare page's key=value search).
            models.Index(fields=["key", "digest", "project"], name="config_value_key_digest"),
            # The key picker: a project's leaf key paths.
            models.Index(
                fields=["project", "key"], condition=models.Q(leaf=True), name="config_value_project_leaf"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.key}={self.text[:40]}"


class MetricRollup(models.Model):
    """A run's metric aggregated over one block of steps, kept at ingest (``webapp.analysis.rollups``):
    the points not superseded with ``block * width <= step < (block + 1) * width``, at a few fixed
    power-of-two widths, so a long series is downsampled by reading about ``max_points`` of these
    rows instead of every point (``webapp.runs.selectors.metric_series``)."""

    # No index of its own: the unique index (run, name, width, block) serves every read.
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="+", db_index=False)
    name = models.CharField(max_length=200)
    width = models.IntegerField(help_text="Steps per block: one of rollups.WIDTHS.")
    block = models.IntegerField(help_text="step // width of the points it holds.")
    count = models.PositiveIntegerField()
    total = models.FloatField(
        help_text="The sum of the values / 2^40 (rollups.SCALE): the mean is total / count * 2^40."
    )
    min = models.FloatField()
    max = models.FloatField()
    first_step = models.IntegerField()
    last_step = models.IntegerField()
    first_time = models.DateTimeField(help_text="The earliest time of its points.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "name", "width", "block"], name="rollup_one_per_block")
        ]

    def __str__(self) -> str:
        return f"{self.name}[{self.block}*{self.width}]: {self.count} points"
