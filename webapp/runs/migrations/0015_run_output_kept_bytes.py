"""``Run.output_kept_bytes``: the committed length of the full log file the web app keeps, stored
rather than derived from ``FULL_LOG_MAX_MB`` (a setting changed after a run reached the cap would
otherwise cut the file or pad it with zero bytes). Until now the file held all that was received."""

from django.db import migrations, models
from django.db.models import F


def fill(apps, schema_editor):
    apps.get_model("runs", "Run").objects.update(output_kept_bytes=F("output_file_bytes"))


class Migration(migrations.Migration):
    dependencies = [("runs", "0014_sample_prompt_hash")]

    operations = [
        migrations.AlterField(
            model_name="run",
            name="output_file_bytes",
            field=models.BigIntegerField(
                default=0,
                help_text="Bytes of output received for the run's full log: the byte space of its lines' offsets.",
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="output_kept_bytes",
            field=models.BigIntegerField(
                default=0,
                help_text="Committed length of the full log file the web app keeps (equal to output_file_bytes "
                "until it reached FULL_LOG_MAX_MB and stopped growing).",
            ),
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
