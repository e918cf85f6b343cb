"""What the run page shows besides the API's run detail: config as YAML, the log tail, page data."""

from __future__ import annotations

from typing import Any

import yaml

from webapp.runs.choices import RunStatus
from webapp.runs.models import LogLine, Run

LOG_TAIL = 500


def config_yaml(config: dict[str, Any]) -> str:
    """The config as the engine's CLI prints it (``python -m engine config``): key order kept."""
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def log_tail(run: Run, limit: int = LOG_TAIL) -> list[LogLine]:
    """The newest ``limit`` log lines, oldest first (the page appends live ones below)."""
    rows = list(LogLine.objects.filter(run=run).order_by("-seq")[:limit])
    rows.reverse()
    return rows


def _ts(value: Any) -> float | None:
    return value.timestamp() if value else None


def page_data(detail: dict[str, Any], metric_names: list[str], token: str = "") -> dict[str, Any]:
    """The JSON the page's scripts start from (rendered with ``json_script``).

    ``metric_names`` lets the page fetch the history of its first chart panel on its own and
    draw it before the rest arrives (a long run's full history takes a while to downsample).
    """
    run_id = detail["id"]
    socket = f"/ws/runs/{run_id}/"
    return {
        "run": {
            "id": run_id,
            "name": detail["name"],
            "status": detail["status"],
            "message": detail["status_message"],
            "is_final": detail["is_final"],
            "last_step": detail["last_step"],
            "last_seq": detail["last_seq"],
            "started_at": _ts(detail["started_at"]),
            "finished_at": _ts(detail["finished_at"]),
            "total_steps": (detail["config"].get("trainer") or {}).get("total_steps"),
            "worker_host": detail["worker_host"],
        },
        "metric_names": metric_names,
        "api": f"/api/shared/{token}" if token else f"/api/runs/{run_id}",
        "socket": socket,
        "share": token,
        "badges": {s.value: s.badge for s in RunStatus},
        "final_statuses": [s.value for s in RunStatus if s.is_final],
    }
