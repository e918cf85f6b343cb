"""What the run page shows besides the API's run detail: config as YAML, page data (the Logs
tab's lines: ``logs.py``)."""

from __future__ import annotations

from typing import Any

import yaml
from django.urls import reverse

from webapp.live.routing import run_socket_path
from webapp.pages.runs.stage_plan import stage_plan
from webapp.runs.choices import RunStatus


def config_yaml(config: dict[str, Any]) -> str:
    """The config as the engine's CLI prints it (``python -m engine config``): key order kept."""
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def api_base(run_id: int, token: str = "") -> str:
    """Where the page's scripts read the run from: the team API, or the share API for a link."""
    if token:
        return reverse("api:shared_run", kwargs={"token": token})
    return reverse("api:get_run", kwargs={"run_id": run_id})


def _ts(value: Any) -> float | None:
    return value.timestamp() if value else None


def points_attempt(detail: dict[str, Any]) -> int:
    """The latest attempt of the run (the API's detail) whose points its history holds: a point of
    a later one is a rewind (``static/tributary/series.js``, ``Attempts``); 0 when none has any."""
    return max((a["number"] for a in detail["attempts"] if a["first_step"] is not None), default=0)


def page_data(detail: dict[str, Any], metric_names: list[str], token: str = "") -> dict[str, Any]:
    """The JSON the page's scripts start from (rendered with ``json_script``).

    ``metric_names`` lets the page fetch the history of its first chart panel on its own and
    draw it before the rest arrives (a long run's full history takes a while to downsample).
    """
    run_id = detail["id"]
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
            "points_attempt": points_attempt(detail),
        },
        "metric_names": metric_names,
        "stages": stage_plan(detail["config"]),  # data.stages: chart marks and the heatmap (stages.js)
        "api": api_base(run_id, token),
        "socket": run_socket_path(run_id),
        "share": token,
        "badges": {s.value: s.badge for s in RunStatus},
    }
