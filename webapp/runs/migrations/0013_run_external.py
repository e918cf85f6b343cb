"""External runs (issue 17): ``Run.origin`` says whether a worker runs Tributary's engine or the
user's own script trains and ships its events; ``Run.client_id`` (unique per project when set)
makes creating one idempotent for a restarted script; ``Run.client_pid`` is the script's process
id from its ingest ``attach``. Existing runs are engine runs."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0012_run_queued_at")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="origin",
            field=models.CharField(
                choices=[("engine", "Engine"), ("external", "External")],
                default="engine",
                help_text="engine: a worker runs Tributary's engine; external: the user's own script trains "
                "and ships its events (no queue, no worker).",
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="client_id",
            field=models.UUIDField(
                blank=True,
                help_text="An external run's id chosen by its script: creating it again with the same id in "
                "the same project returns this run (a restarted script, a retried request).",
                null=True,
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="client_pid",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="An external run's script's process id, from its ingest attach.",
                null=True,
            ),
        ),
        migrations.AlterField(
            model_name="run",
            name="config",
            field=models.JSONField(
                default=dict,
                help_text="An engine run's RunConfig, validated by the engine's schema; an external run's "
                "free-form config from its script (bounded, never validated or executed).",
            ),
        ),
        migrations.AddConstraint(
            model_name="run",
            constraint=models.UniqueConstraint(
                condition=models.Q(client_id__isnull=False),
                fields=("project", "client_id"),
                name="run_one_per_project_client_id",
            ),
        ),
    ]
