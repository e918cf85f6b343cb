from django.apps import AppConfig


class PagesConfig(AppConfig):
    """The server-rendered pages, built on the domain selectors and the run/project sockets.
    Each page package (launch, rollouts, runs, teams) keeps its templates beside its views."""

    name = "webapp.pages"
    label = "pages"
