from django.apps import AppConfig


class PagesConfig(AppConfig):
    """The server-rendered pages (templates/pages), built on the JSON API's queries and the
    run/project sockets."""

    name = "webapp.pages"
    label = "pages"
