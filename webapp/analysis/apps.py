from django.apps import AppConfig
from django.db.models.signals import post_save


class AnalysisConfig(AppConfig):
    name = "webapp.analysis"
    label = "analysis"

    def ready(self) -> None:
        # Every save of a run that sets its config keeps the table's rows of it (config_values).
        from webapp.analysis.config_values import on_run_saved
        from webapp.runs.models import Run

        post_save.connect(on_run_saved, sender=Run, dispatch_uid="analysis.config_values")
