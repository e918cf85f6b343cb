"""The stages of a continual-training run (``data.stages``, engine/config/stages.py) for the run page:
where the charts mark a boundary and in which order the accuracy heatmap lists the stages
(static/tributary/stages.js).

The config is read as stored: an engine run's was validated, an external run's is whatever its
script sent, so anything that is not a list of ``{name: str, steps: int > 0}`` yields no stages
rather than an error (the page must render whatever the run holds)."""

from __future__ import annotations

from typing import Any

MAX_STAGES = 200
"""More stages than this are not marked (a config that large is not a stage plan a page can show)."""


def stage_plan(config: Any) -> list[dict[str, Any]]:
    """``[{name, first, last}]``: each stage's name and its first and last step (1-based, inclusive)."""
    data = config.get("data") if isinstance(config, dict) else None
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, list) or not stages or len(stages) > MAX_STAGES:
        return []
    out: list[dict[str, Any]] = []
    start = 0
    for stage in stages:
        name = stage.get("name") if isinstance(stage, dict) else None
        steps = stage.get("steps") if isinstance(stage, dict) else None
        if not isinstance(name, str) or not name or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            return []
        out.append({"name": name[:64], "first": start + 1, "last": start + steps})
        start += steps
    return out
