"""Share links: members make and revoke them; anyone holding a live token reads one run."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from django.test import Client

from webapp.runs.models import MetricPoint, Run, Sample, ShareLink


@pytest.fixture
def shared_run(api_run: Run) -> Run:
    MetricPoint.objects.bulk_create(
        MetricPoint(run=api_run, name="reward/mean", step=s, value=s / 10, time=datetime.now(UTC), seq=s)
        for s in range(1, 31)
    )
    Sample.objects.bulk_create(
        Sample(run=api_run, step=s, seq=100 + s, prompt=f"p{s}", completion=f"c{s}", reward=s, length=s)
        for s in (10, 20)
    )
    return api_run


def test_member_creates_lists_and_revokes(
    shared_run: Run, member: Any, client_for: Callable[..., Client]
) -> None:
    client = client_for(member)
    url = f"/api/runs/{shared_run.pk}/shares"
    created = client.post(url)
    assert created.status_code == 201, created.content
    body = created.json()
    token = body["token"]
    assert body["path"] == f"/share/{token}/" and body["api_path"] == f"/api/shared/{token}"
    assert body["active"] is True and body["created_by"] == "bob-member" and body["run_id"] == shared_run.pk
    assert [s["id"] for s in client.get(url).json()] == [body["id"]]

    assert client.delete(f"{url}/{body['id']}").status_code == 204
    listed = client.get(url).json()
    assert listed[0]["active"] is False and listed[0]["revoked_at"] is not None
    assert client.delete(f"{url}/{body['id']}").status_code == 204  # revoking twice is harmless
    assert client.delete(f"{url}/999999").status_code == 404


def test_a_share_link_of_another_run_is_not_reachable_through_this_one(
    shared_run: Run, make_run: Callable[..., Run], member: Any, client_for: Callable[..., Client]
) -> None:
    other = ShareLink.create(make_run(name="other"), member)
    response = client_for(member).delete(f"/api/runs/{shared_run.pk}/shares/{other.pk}")
    assert response.status_code == 404
    other.refresh_from_db()
    assert other.revoked_at is None


def test_anyone_with_the_token_reads_the_run(
    shared_run: Run, member: Any, viewer: Any, client_for: Callable[..., Client]
) -> None:
    token = ShareLink.create(shared_run, member).token
    anonymous = client_for(None)
    run = anonymous.get(f"/api/shared/{token}")
    assert run.status_code == 200, run.content
    body = run.json()
    # The same fields as the team's view, read-only.
    team_view = client_for(viewer).get(f"/api/runs/{shared_run.pk}").json()
    assert body.keys() == team_view.keys()
    assert body["id"] == shared_run.pk and body["config"] == shared_run.config
    assert body["role"] is None and not any(body["permissions"].values())

    metrics = anonymous.get(f"/api/shared/{token}/metrics").json()
    assert metrics[0]["name"] == "reward/mean" and metrics[0]["count"] == 30
    series = anonymous.get(f"/api/shared/{token}/metrics/series?names=reward/mean&max_points=10").json()
    assert series["series"][0]["downsampled"] is True and series["series"][0]["step"][-1] == 30
    samples = anonymous.get(f"/api/shared/{token}/samples?step=latest").json()
    assert samples["step"] == 20 and [s["prompt"] for s in samples["items"]] == ["p20"]
    steps = anonymous.get(f"/api/shared/{token}/samples/steps").json()
    assert steps == [{"step": 10, "count": 1}, {"step": 20, "count": 1}]
    csv_response = anonymous.get(f"/api/shared/{token}/metrics.csv")
    assert b"".join(csv_response.streaming_content).startswith(b"step,reward/mean\n1,0.1\n")


SHARED_PATHS = ["", "/metrics", "/metrics/series", "/metrics.csv", "/samples", "/samples/steps"]


@pytest.mark.parametrize("suffix", SHARED_PATHS)
def test_revoked_or_unknown_token_is_404(
    suffix: str, shared_run: Run, member: Any, client_for: Callable[..., Client]
) -> None:
    link = ShareLink.create(shared_run, member)
    client = client_for(None)
    assert client.get(f"/api/shared/{link.token}{suffix}").status_code == 200
    client_for(member).delete(f"/api/runs/{shared_run.pk}/shares/{link.pk}")
    revoked = client.get(f"/api/shared/{link.token}{suffix}")
    assert revoked.status_code == 404
    assert revoked.json() == {"detail": "this share link does not exist or was revoked"}
    assert client.get(f"/api/shared/not-a-token{suffix}").status_code == 404


def test_a_share_token_opens_nothing_else(
    shared_run: Run, member: Any, client_for: Callable[..., Client]
) -> None:
    token = ShareLink.create(shared_run, member).token
    client = client_for(None)
    # Not a login: the team API stays closed to its holder.
    assert client.get(f"/api/runs/{shared_run.pk}", HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 401
    assert client.post(f"/api/shared/{token}").status_code == 405
