from django.apps import AppConfig


class EmbeddedConfig(AppConfig):
    """Embedded mode: the whole platform on one machine in one command (``manage.py serve``,
    supervised by ``webapp.embedded.supervisor``)."""

    name = "webapp.embedded"
    label = "embedded"
