"""``Run.queued_at``: a queue's order is by when a run was last queued, so a resumed run waits
behind the runs queued before its resume (ordered by ``created_at``, it went ahead of them).
Existing runs take their creation time, the order they had."""

import django.utils.timezone
from django.db import migrations, models
from django.db.models import F


def from_created_at(apps, schema_editor):
    apps.get_model("runs", "Run").objects.update(queued_at=F("created_at"))


class Migration(migrations.Migration):
    dependencies = [("runs", "0011_attempt_engine_from_seq")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="queued_at",
            field=models.DateTimeField(
                default=django.utils.timezone.now,
                help_text="When it was last queued (its launch or its latest resume): its place in the queue's order.",
            ),
        ),
        migrations.RunPython(from_created_at, migrations.RunPython.noop),
    ]
