from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0004_ingest_hardening"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="claim",
            field=models.CharField(
                blank=True,
                help_text="The claim id of the supervisor that won the run's start: only it may start the engine.",
                max_length=64,
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="resume_path",
            field=models.TextField(
                blank=True,
                help_text="Where the engine resumes from when not resume_from's own path (e.g. the parent's "
                "checkpoint directory: the newest there); kept so a queue message can be sent again.",
            ),
        ),
    ]
