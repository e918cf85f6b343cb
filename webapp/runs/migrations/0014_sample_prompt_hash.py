"""``Sample.prompt_hash`` (issue 18, two runs' completions of one prompt side by side): the MD5 of the
prompt, indexed with the run and step, so a prompt's samples are found by an index on SQLite and
PostgreSQL alike, in one run or across a project's runs. Existing rows are filled in batches of ids
(the digest is computed in Python: SQLite has no MD5 function)."""

import hashlib

from django.db import migrations, models

BATCH = 2000


def fill(apps, schema_editor):
    Sample = apps.get_model("runs", "Sample")
    last = 0
    while True:
        rows = list(Sample.objects.filter(pk__gt=last).order_by("pk").only("pk", "prompt")[:BATCH])
        if not rows:
            break
        for row in rows:
            # runs.models.prompt_hash, frozen here as migrations are
            row.prompt_hash = hashlib.md5(
                row.prompt.encode("utf-8", "surrogatepass"), usedforsecurity=False
            ).hexdigest()
        Sample.objects.bulk_update(rows, ["prompt_hash"])  # one statement per batch
        last = rows[-1].pk


class Migration(migrations.Migration):
    dependencies = [("runs", "0013_run_external")]

    operations = [
        migrations.AddField(
            model_name="sample",
            name="prompt_hash",
            field=models.CharField(
                blank=True,
                default="",
                help_text="MD5 of the prompt text (runs.models.prompt_hash).",
                max_length=32,
            ),
        ),
        migrations.RunPython(fill, migrations.RunPython.noop, elidable=True),
        migrations.AddIndex(
            model_name="sample",
            index=models.Index(fields=["prompt_hash", "run", "step"], name="sample_prompt_run_step"),
        ),
    ]
