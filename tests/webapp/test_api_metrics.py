"""Metric names, series with downsampling in the database, and the CSV export."""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client

from webapp.runs import selectors
from webapp.runs.models import MetricPoint, Run

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def add_points(run: Run, name: str, steps: list[int], values: list[float], dt: float = 1.5) -> None:
    MetricPoint.objects.bulk_create(
        (
            MetricPoint(run=run, name=name, step=s, value=v, time=T0 + timedelta(seconds=s * dt), seq=s)
            for s, v in zip(steps, values, strict=True)
        ),
        batch_size=2000,
    )


@pytest.fixture
def viewer_client(viewer: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(viewer)


def series(client: Client, run: Run, query: str) -> dict[str, Any]:
    response = client.get(f"/api/runs/{run.pk}/metrics/series{query}")
    assert response.status_code == 200, response.content
    return response.json()


def test_metric_names_with_counts_and_last_value(api_run: Run, viewer_client: Client) -> None:
    add_points(api_run, "reward/mean", [1, 2, 3], [0.1, 0.2, 0.3])
    add_points(api_run, "actor/entropy", [2, 4], [1.5, 1.25])
    body = viewer_client.get(f"/api/runs/{api_run.pk}/metrics").json()
    assert body == [
        {"name": "actor/entropy", "count": 2, "first_step": 2, "last_step": 4, "last_value": 1.25},
        {"name": "reward/mean", "count": 3, "first_step": 1, "last_step": 3, "last_value": 0.3},
    ]


def test_short_series_come_back_whole(api_run: Run, viewer_client: Client) -> None:
    add_points(api_run, "reward/mean", [0, 1, 2, 5], [0.0, 0.5, -1.0, 2.0])
    add_points(api_run, "actor/kl", [1, 2], [0.01, 0.02])
    body = series(viewer_client, api_run, "?names=reward/mean,actor/kl&names=missing")
    assert body["run_id"] == api_run.pk and body["x"] == "step"
    reward, kl, missing = body["series"]
    assert (
        reward["name"] == "reward/mean" and reward["downsampled"] is False and reward["bucket_width"] is None
    )
    assert reward["step"] == [0, 1, 2, 5] and reward["value"] == [0.0, 0.5, -1.0, 2.0]
    assert reward["time"] == [(T0 + timedelta(seconds=1.5 * s)).timestamp() for s in [0, 1, 2, 5]]
    assert reward["min"] is None and reward["max"] is None and reward["total"] == 4
    assert kl["step"] == [1, 2]
    assert missing == {**missing, "total": 0, "step": [], "value": [], "downsampled": False}
    # Live updates: only what came after a step.
    later = series(viewer_client, api_run, "?names=reward/mean&after_step=1")["series"][0]
    assert later["step"] == [2, 5] and later["total"] == 2
    # No names: every metric of the run, by name.
    assert [s["name"] for s in series(viewer_client, api_run, "")["series"]] == ["actor/kl", "reward/mean"]


def bucket_width(lo: int, hi: int, max_points: int) -> int:
    width = 1
    while len(range((lo + 1) // width, (hi - 1) // width + 1)) > max_points - 2:
        width *= 2
    return width


def python_buckets(points: list[tuple[int, float]], max_points: int) -> list[tuple[int, float, float, float]]:
    """The documented rule: first and last kept; inner step s in bucket s // width, width the
    smallest power of two that makes at most max_points - 2 buckets."""
    points = sorted(points)
    lo, hi = points[0][0], points[-1][0]
    width = bucket_width(lo, hi, max_points)
    buckets: dict[int, list[tuple[int, float]]] = {}
    for step, value in points[1:-1]:
        buckets.setdefault(step // width, []).append((step, value))
    out = [(lo, points[0][1], points[0][1], points[0][1])]
    for key in sorted(buckets):
        items = buckets[key]
        values = [v for _, v in items]
        out.append((items[0][0], sum(values) / len(values), min(values), max(values)))
    out.append((hi, points[-1][1], points[-1][1], points[-1][1]))
    return out


@pytest.mark.parametrize("max_points", [1000, 137])
def test_long_series_are_downsampled_in_the_database(
    max_points: int, api_run: Run, viewer_client: Client
) -> None:
    rng = random.Random(7)
    steps = list(range(3, 20_003, 2))  # 10,000 points, odd steps
    values = [math.sin(s / 300) + rng.gauss(0, 0.3) for s in steps]
    add_points(api_run, "reward/mean", steps, values)
    body = series(viewer_client, api_run, f"?names=reward/mean&max_points={max_points}")
    got = body["series"][0]
    assert got["downsampled"] is True and got["total"] == 10_000
    assert len(got["step"]) <= max_points
    assert len(got["step"]) == len(got["value"]) == len(got["time"]) == len(got["min"]) == len(got["max"])
    expected = python_buckets(list(zip(steps, values)), max_points)
    assert got["step"] == [e[0] for e in expected]
    assert got["min"] == [e[2] for e in expected]
    assert got["max"] == [e[3] for e in expected]
    assert got["value"] == pytest.approx([e[1] for e in expected], rel=1e-9, abs=1e-12)
    assert got["bucket_width"] == bucket_width(steps[0], steps[-1], max_points)
    assert (max_points - 2) // 2 < len(got["step"]) - 2 <= max_points - 2
    # The first and last points are exactly the stored ones; the band holds every value.
    assert (got["step"][0], got["value"][0]) == (steps[0], values[0])
    assert (got["step"][-1], got["value"][-1]) == (steps[-1], values[-1])
    assert got["time"][0] == (T0 + timedelta(seconds=1.5 * steps[0])).timestamp()
    assert min(got["min"]) == min(values) and max(got["max"]) == max(values)
    assert all(lo <= v <= hi for lo, v, hi in zip(got["min"], got["value"], got["max"]))
    assert got["step"] == sorted(got["step"])


def test_downsampling_with_gaps_and_after_step(api_run: Run, viewer_client: Client) -> None:
    # Steps with a big hole in the middle: empty buckets are simply absent.
    steps = list(range(0, 500)) + list(range(5000, 5500))
    values = [float(s % 17) for s in steps]
    add_points(api_run, "loss", steps, values)
    got = series(viewer_client, api_run, "?names=loss&max_points=50")["series"][0]
    assert got["downsampled"] is True
    assert got["step"] == [e[0] for e in python_buckets(list(zip(steps, values)), 50)]
    assert got["min"] == [e[2] for e in python_buckets(list(zip(steps, values)), 50)]
    tail = series(viewer_client, api_run, "?names=loss&max_points=50&after_step=5100")["series"][0]
    assert tail["total"] == 399 and tail["step"][0] == 5101 and tail["step"][-1] == 5499
    kept = [(s, v) for s, v in zip(steps, values) if s > 5100]
    assert tail["max"] == [e[3] for e in python_buckets(kept, 50)]


def test_every_series_or_all_but_some(api_run: Run, viewer_client: Client) -> None:
    """The run page asks for its first panel's series, then for the rest with ``exclude``."""
    add_points(api_run, "reward/mean", [1, 2, 3], [0.1, 0.2, 0.3])
    add_points(api_run, "actor/entropy", [2, 4], [1.5, 1.25])
    add_points(api_run, "actor/kl_loss", [1], [0.5])
    names = lambda q: [s["name"] for s in series(viewer_client, api_run, q)["series"]]  # noqa: E731
    assert names("") == ["actor/entropy", "actor/kl_loss", "reward/mean"]
    assert names("?exclude=reward/mean") == ["actor/entropy", "actor/kl_loss"]
    assert names("?exclude=reward/mean,actor/kl_loss&exclude=nothing") == ["actor/entropy"]
    assert names("?names=reward/mean,actor/kl_loss&exclude=actor/kl_loss") == ["reward/mean"]
    assert names("?exclude=reward/mean,actor/kl_loss,actor/entropy") == []
    # Without names, only the metrics with points after after_step come back.
    assert names("?after_step=3") == ["actor/entropy"]
    assert selectors.metric_name_list(api_run) == ["actor/entropy", "actor/kl_loss", "reward/mean"]
    assert (
        selectors.metric_name_list(Run.objects.create(project=api_run.project, name="empty", config={})) == []
    )


def test_downsampling_along_wall_clock_time(api_run: Run, viewer_client: Client) -> None:
    steps = list(range(0, 3000))
    values = [float(s) for s in steps]
    add_points(api_run, "throughput", steps, values, dt=2.0)
    got = series(viewer_client, api_run, "?names=throughput&max_points=102&x=time")
    assert got["x"] == "time"
    s = got["series"][0]
    assert s["downsampled"] is True and len(s["step"]) <= 102
    assert s["bucket_width"] == pytest.approx((steps[-1] - steps[0]) * 2.0 / 100)
    assert (s["step"][0], s["step"][-1]) == (0, 2999)
    # Time advances with the step here, so each time bucket is a run of consecutive steps.
    assert s["min"][1:-1] == [float(step) for step in s["step"][1:-1]]
    assert sum(1 for _ in s["step"]) >= 95
    assert min(s["min"]) == 0.0 and max(s["max"]) == 2999.0


@pytest.mark.parametrize("query", ["?max_points=5", "?max_points=100000", "?x=seq", "?after_step=abc"])
def test_bad_series_queries_are_422(query: str, api_run: Run, viewer_client: Client) -> None:
    response = viewer_client.get(f"/api/runs/{api_run.pk}/metrics/series{query}")
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][0] == "query"


def read_csv(response: Any) -> list[list[str]]:
    assert response.status_code == 200
    assert response.streaming
    text = b"".join(response.streaming_content).decode()
    return list(csv.reader(io.StringIO(text)))


def test_csv_wide_reads_back_as_the_stored_points(api_run: Run, viewer_client: Client) -> None:
    rng = random.Random(3)
    reward = {s: rng.random() for s in range(0, 300)}
    entropy = {s: rng.random() * 1e-7 for s in range(0, 300, 3)}
    add_points(api_run, "reward/mean", list(reward), list(reward.values()))
    add_points(api_run, "actor/entropy", list(entropy), list(entropy.values()))
    api_run.name = "GRPO baseline #2"
    api_run.save(update_fields=["name"])
    response = viewer_client.get(f"/api/runs/{api_run.pk}/metrics.csv")
    assert response["Content-Type"].startswith("text/csv")
    assert (
        response["Content-Disposition"]
        == f'attachment; filename="run-{api_run.pk}-grpo-baseline-2-metrics.csv"'
    )
    rows = read_csv(response)
    assert rows[0] == ["step", "actor/entropy", "reward/mean"]
    assert len(rows) == 1 + 300
    got_reward = {int(r[0]): float(r[2]) for r in rows[1:] if r[2]}
    got_entropy = {int(r[0]): float(r[1]) for r in rows[1:] if r[1]}
    assert got_reward == reward and got_entropy == entropy  # exactly, not approximately
    assert [int(r[0]) for r in rows[1:]] == sorted(reward)


def test_csv_long_format_and_a_subset_of_names(api_run: Run, viewer_client: Client) -> None:
    add_points(api_run, "a", [1, 2, 3], [0.1, 1 / 3, -2.5e300])
    add_points(api_run, "b", [2], [7.0])
    add_points(api_run, "c", [1], [9.0])
    response = viewer_client.get(f"/api/runs/{api_run.pk}/metrics.csv?format=long&names=a,b")
    assert response["Content-Disposition"].endswith('-metrics-long.csv"')
    rows = read_csv(response)
    assert rows[0] == ["step", "name", "value", "time"]
    stored = {
        (p.step, p.name, p.value, p.time)
        for p in MetricPoint.objects.filter(run=api_run, name__in=["a", "b"])
    }
    assert {(int(s), n, float(v), datetime.fromisoformat(t)) for s, n, v, t in rows[1:]} == stored
    assert len(rows) == 1 + 4


def test_csv_of_a_run_without_metrics(api_run: Run, viewer_client: Client) -> None:
    assert read_csv(viewer_client.get(f"/api/runs/{api_run.pk}/metrics.csv")) == [["step"]]
    assert viewer_client.get(f"/api/runs/{api_run.pk}/metrics.csv?format=tall").status_code == 422
