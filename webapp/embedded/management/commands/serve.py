"""``python manage.py serve``: Tributary on this machine, in one command (the web server and one
Celery worker, supervised by ``webapp.embedded.supervisor``)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from webapp.embedded.supervisor import Platform, parse_queues


class Command(BaseCommand):
    help = (
        "Run Tributary on this machine: migrations, the demo login/team/project/run, then the web "
        "server (uvicorn) and one Celery worker together. Ctrl-C stops the worker first, then the web server."
    )
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
        parser.add_argument(
            "--no-demo", action="store_true", help="create no demo user, team, project or run"
        )
        parser.add_argument(
            "--queues", default="cpu", help="comma-separated queues the worker takes runs from (default cpu)"
        )
        parser.add_argument(
            "--stop-timeout",
            type=float,
            default=60.0,
            help="seconds the worker gets to checkpoint its run and exit on Ctrl-C before SIGKILL (default 60)",
        )
        parser.add_argument("--access-log", action="store_true", help="forward the web server's access log")

    def handle(self, *args: Any, **options: Any) -> None:
        Platform(
            self.stdout,
            host=options["host"],
            port=options["port"],
            queues=parse_queues(options["queues"]),
            demo=not options["no_demo"],
            stop_timeout=options["stop_timeout"],
            access_log=options["access_log"],
        ).run()
