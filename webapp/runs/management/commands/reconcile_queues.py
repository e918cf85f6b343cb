from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from webapp.runs.reconcile import reconcile_queued_runs


class Command(BaseCommand):
    help = (
        "Send again the queued runs whose broker message is gone, oldest first (the web server also "
        "does this every RECONCILE_EVERY seconds)."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        sent = reconcile_queued_runs(wait=True)
        self.stdout.write(
            f"{len(sent)} run(s) sent again" + (f": {', '.join(map(str, sent))}" if sent else "")
        )
