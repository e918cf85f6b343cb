"""The series endpoint's fast paths (issue 18, compare page): the JSON pydantic-core writes is the
document ninja's renderer wrote (same keys, same floats), the shared link's series too, and the
SQLite time text is read as the same Unix seconds as before."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.test import Client
from hypothesis import given
from hypothesis import strategies as st
from ninja.responses import NinjaJSONEncoder

from webapp.api.schemas import SeriesSetOut
from webapp.runs import selectors
from webapp.runs.models import MetricPoint, Run, ShareLink

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _points(run: Run, name: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    MetricPoint.objects.bulk_create(
        MetricPoint(
            run=run,
            name=name,
            step=s,
            value=rng.choice(
                [rng.gauss(0, 1), rng.uniform(-1e-7, 1e-7), rng.uniform(1e15, 1e300), 0.0, -2.5]
            ),
            time=T0 + timedelta(seconds=s * 1.37, microseconds=rng.randrange(10**6)),
            seq=s,
        )
        for s in range(1, n + 1)
    )


def test_the_series_json_is_the_document_ninja_wrote(
    api_run: Run, viewer: Any, client_for: Callable[..., Client]
) -> None:
    _points(api_run, "reward/mean", 3000, 1)  # downsampled: step, value, time, min, max
    _points(api_run, "actor/kl", 40, 2)  # whole: min and max null
    response = client_for(viewer).get(f"/api/runs/{api_run.pk}/metrics/series?max_points=100")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    got = json.loads(response.content)
    expected = {
        "run_id": api_run.pk,
        "x": "step",
        "max_points": 100,
        "series": selectors.metric_series(api_run, [], max_points=100, after_step=None, x="step"),
    }
    rendered = json.loads(
        json.dumps(SeriesSetOut.model_validate(expected).model_dump(), cls=NinjaJSONEncoder)
    )
    assert got == rendered
    reward = next(s for s in got["series"] if s["name"] == "reward/mean")
    assert reward["downsampled"] and len(reward["min"]) == len(reward["step"]) <= 100
    assert all(type(v) is float for v in reward["value"] + reward["time"])  # 0.0 stays a float


def test_the_shared_link_serves_the_same_series(
    api_run: Run, viewer: Any, member: Any, client_for: Callable[..., Client]
) -> None:
    _points(api_run, "reward/mean", 500, 3)
    link = ShareLink.create(api_run, member)
    query = "metrics/series?max_points=50"
    own = client_for(viewer).get(f"/api/runs/{api_run.pk}/{query}").json()
    shared = Client().get(f"/api/shared/{link.token}/{query}")
    assert shared.status_code == 200
    assert shared.json() == own


@given(
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1)),
    st.sampled_from(["", "+00:00"]),
)
def test_time_text_reads_as_the_same_seconds(moment: datetime, offset: str) -> None:
    # What Django writes in SQLite ("YYYY-MM-DD HH:MM:SS[.ffffff]") and what a direct insert of
    # an aware datetime's isoformat() leaves (bench/ui.py): both UTC.
    text = moment.isoformat(sep=" ") + offset
    assert selectors._seconds(text) == moment.replace(tzinfo=UTC).timestamp()
    assert selectors._seconds(moment.replace(tzinfo=UTC)) == moment.replace(tzinfo=UTC).timestamp()
