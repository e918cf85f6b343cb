from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from webapp.runs.sweeper import sweep_lost_runs


class Command(BaseCommand):
    help = "Mark runs whose worker went silent past LOST_AFTER seconds as lost (the web server also does this)."

    def handle(self, *args: Any, **options: Any) -> None:
        lost = sweep_lost_runs()
        self.stdout.write(f"{len(lost)} run(s) marked lost" + (f": {', '.join(map(str, lost))}" if lost else ""))
