"""The engine's output on the run page (issue 15): a byte cursor per run and the newest lines."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0008_run_archived")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="output_stream",
            field=models.CharField(
                blank=True,
                max_length=200,
                help_text="The worker's output file (host:device:inode) output_bytes is of.",
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="output_bytes",
            field=models.BigIntegerField(
                default=0, help_text="Output cursor: the byte of that file up to which the output is stored."
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="output_file_bytes",
            field=models.BigIntegerField(
                default=0, help_text="Committed length of the run's stored full log."
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="output_lines_dropped",
            field=models.BigIntegerField(
                default=0,
                help_text="Output lines deleted to keep the newest OUTPUT_LINES_KEPT (the full log has them).",
            ),
        ),
        migrations.CreateModel(
            name="OutputLine",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("offset", models.BigIntegerField()),
                (
                    "level",
                    models.CharField(
                        choices=[
                            ("debug", "Debug"),
                            ("info", "Info"),
                            ("warning", "Warning"),
                            ("error", "Error"),
                        ],
                        default="info",
                        max_length=16,
                    ),
                ),
                ("message", models.TextField()),
                ("time", models.DateTimeField()),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="output_lines",
                        to="runs.run",
                    ),
                ),
            ],
            options={
                "ordering": ["offset"],
                "constraints": [
                    models.UniqueConstraint(fields=("run", "offset"), name="outputline_one_per_run_offset")
                ],
            },
        ),
    ]
