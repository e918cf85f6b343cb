from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0009_log_output")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="alert_state",
            field=models.JSONField(
                blank=True, default=dict, help_text="Each health rule's state between batches."
            ),
        ),
        migrations.AddField(
            model_name="run",
            name="alert_overrides",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="This run's health rule settings over its project's: {rule: {...}}.",
            ),
        ),
    ]
