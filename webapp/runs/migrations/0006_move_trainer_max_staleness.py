"""Configs stored before the ``async`` section existed carry ``trainer.max_staleness``; the engine's
config now refuses that field (it lives at ``async.max_staleness``), so such a run could no longer
be forked, cloned or resumed. Move the value where the config expects it."""

from django.db import migrations


def move_max_staleness(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    for run in Run.objects.filter(config__trainer__has_key="max_staleness").iterator():
        trainer = run.config["trainer"]
        moved = trainer.pop("max_staleness")
        section = run.config.get("async")
        if not isinstance(section, dict):
            section = run.config["async"] = {}
        section.setdefault("max_staleness", moved)
        run.save(update_fields=["config"])


class Migration(migrations.Migration):
    dependencies = [("runs", "0005_claim_resume_path")]

    operations = [migrations.RunPython(move_max_staleness, migrations.RunPython.noop)]
