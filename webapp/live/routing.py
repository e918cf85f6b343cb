"""WebSocket routes. Workers and browsers are separated: browser sockets check the Origin
header and the session; the ingest socket is authenticated by its per-run token alone
(a worker sends no Origin and has no session)."""

from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from webapp.live.consumers import IngestConsumer, ProjectConsumer, RunConsumer


def _browser(consumer: type) -> object:
    return AllowedHostsOriginValidator(AuthMiddlewareStack(consumer.as_asgi()))


def run_socket_path(run_id: int) -> str:
    """The path of a run's browser socket (``RunConsumer``), for the pages' scripts."""
    return f"/ws/runs/{run_id}/"


def websocket_application() -> URLRouter:
    return URLRouter(
        [
            path("ws/ingest/<int:run_id>/", IngestConsumer.as_asgi()),
            path("ws/runs/<int:run_id>/", _browser(RunConsumer)),
            path("ws/projects/<int:project_id>/", _browser(ProjectConsumer)),
        ]
    )
