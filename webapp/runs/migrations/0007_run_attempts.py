"""A resume continues the same run: its attempts (``RunAttempt``) and, on the records an attempt
writes, which attempt wrote them and whether a later attempt superseded them (a resume from an
earlier step logs those steps again).

Every existing run gets its attempt 1 from what the run row says. Runs resumed before this
migration are child runs (``ParentKind.RESUME``) and stay so: each is its own run with its own
attempt 1, started from its parent's checkpoint (``from_checkpoint``)."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

FINAL = ("succeeded", "failed", "cancelled", "lost")


def first_attempts(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    RunAttempt = apps.get_model("runs", "RunAttempt")
    batch = []
    for run in Run.objects.select_related("resume_from").iterator(chunk_size=500):
        final = run.status in FINAL
        batch.append(
            RunAttempt(
                run_id=run.pk,
                number=1,
                queued_at=run.created_at,
                started_at=run.started_at,
                ended_at=run.finished_at if final else None,
                worker_host=run.worker_host,
                from_checkpoint_id=run.resume_from_id,
                from_step=run.resume_from.step if run.resume_from_id else None,
                status=run.status if final else "",
                message=run.status_message if final else "",
                first_seq=1 if run.last_seq else None,
                last_seq=run.last_seq or None,
                created_by_id=run.created_by_id,
            )
        )
        if len(batch) >= 500:
            RunAttempt.objects.bulk_create(batch)
            batch = []
    RunAttempt.objects.bulk_create(batch)


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0006_move_trainer_max_staleness"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="RunAttempt",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("number", models.PositiveIntegerField()),
                ("queued_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                ("worker_host", models.CharField(blank=True, max_length=255)),
                (
                    "from_step",
                    models.IntegerField(
                        blank=True,
                        help_text="The step of the checkpoint it resumed from (None: from the start).",
                        null=True,
                    ),
                ),
                (
                    "first_step",
                    models.IntegerField(
                        blank=True,
                        help_text="The step of its first metrics or samples event (None: none yet).",
                        null=True,
                    ),
                ),
                (
                    "status",
                    models.CharField(
                        blank=True,
                        choices=[
                            ("queued", "Queued"),
                            ("starting", "Starting"),
                            ("running", "Running"),
                            ("succeeded", "Succeeded"),
                            ("failed", "Failed"),
                            ("cancelled", "Cancelled"),
                            ("lost", "Lost"),
                        ],
                        help_text="How it ended (blank while it runs).",
                        max_length=16,
                    ),
                ),
                ("message", models.TextField(blank=True)),
                ("first_seq", models.BigIntegerField(blank=True, null=True)),
                ("last_seq", models.BigIntegerField(blank=True, null=True)),
                (
                    "created_by",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                (
                    "from_checkpoint",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="resumed_attempts",
                        to="runs.checkpoint",
                    ),
                ),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="attempts", to="runs.run"
                    ),
                ),
            ],
            options={
                "ordering": ["run", "number"],
                "constraints": [
                    models.UniqueConstraint(fields=("run", "number"), name="attempt_one_per_run_number")
                ],
            },
        ),
        migrations.RemoveConstraint(model_name="metricpoint", name="metric_one_per_run_name_step"),
        migrations.AddField(
            model_name="checkpoint",
            name="attempt",
            field=models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that wrote it."),
        ),
        migrations.AddField(
            model_name="checkpoint",
            name="superseded",
            field=models.BooleanField(
                default=False,
                help_text="A later attempt resumed from an earlier step: this checkpoint is off the run's history "
                "(its files may be overwritten by the new branch's checkpoint of the same step), so it is not offered.",
            ),
        ),
        migrations.AddField(
            model_name="metricpoint",
            name="attempt",
            field=models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that logged it."),
        ),
        migrations.AddField(
            model_name="metricpoint",
            name="superseded",
            field=models.BooleanField(
                default=False,
                help_text="A later attempt resumed from an earlier step and logged this step again: kept, not "
                "charted by default.",
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="attempt_number",
            field=models.PositiveIntegerField(
                default=1,
                help_text="The number of the run's current RunAttempt (1 for its launch, + 1 for each resume); "
                "its events are stored under it.",
            ),
        ),
        migrations.AddField(
            model_name="sample",
            name="attempt",
            field=models.PositiveIntegerField(default=1, help_text="The RunAttempt.number that logged it."),
        ),
        migrations.AddField(
            model_name="sample",
            name="superseded",
            field=models.BooleanField(default=False, help_text="A later attempt logged its step again."),
        ),
        migrations.AddConstraint(
            model_name="metricpoint",
            constraint=models.UniqueConstraint(
                fields=("run", "name", "step", "attempt"), name="metric_one_per_run_name_step_attempt"
            ),
        ),
        migrations.AddIndex(
            model_name="metricpoint",
            index=models.Index(
                condition=models.Q(("superseded", True)),
                fields=["run", "name", "step"],
                name="metric_superseded",
            ),
        ),
        migrations.AlterField(
            model_name="run",
            name="resume_from",
            field=models.ForeignKey(
                blank=True,
                help_text="The checkpoint the current attempt resumes from (for a child run of before resumes "
                "continued the same run: its parent's).",
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="resumed_by",
                to="runs.checkpoint",
            ),
        ),
        migrations.AlterField(
            model_name="run",
            name="resume_path",
            field=models.TextField(
                blank=True,
                help_text="Where the engine resumes from when not resume_from's own path (the run's checkpoint "
                "directory: the newest there); kept so a queue message can be sent again.",
            ),
        ),
        migrations.RunPython(first_attempts, migrations.RunPython.noop),
    ]
