from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "webapp.runs"
    label = "runs"

    def ready(self) -> None:
        from webapp.runs import lookups  # noqa: F401 (registers __search on text fields)
