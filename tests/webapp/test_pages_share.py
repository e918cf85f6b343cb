"""The share page: the run page read-only for whoever holds a live token, nothing else."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from django.test import Client
from django.utils import timezone

from webapp.runs.models import LogLine, Run, ShareLink


def _data(page: str) -> dict[str, Any]:
    match = re.search(r'<script id="run-data" type="application/json">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


def test_anyone_with_the_token_sees_the_run_read_only(client: Client, member: Any, api_run: Run) -> None:
    Run.objects.filter(pk=api_run.pk).update(notes="shared notes")
    link = ShareLink.create(api_run, member)
    response = client.get(f"/share/{link.token}/")  # not signed in
    assert response.status_code == 200
    page = response.content.decode()
    assert api_run.name in page and "shared notes" in page and "shared, read-only" in page
    for marker in (
        "cancel-form",
        "resume-form",
        "fork-link",
        "meta-form",
        "share-create",
        "csrfmiddlewaretoken",
    ):
        assert marker not in page, marker
    # Logs and checkpoints are not part of what a link shares (as in /api/shared/<token>/...).
    assert 'id="tab-logs"' not in page and 'id="tab-checkpoints"' not in page
    assert 'id="tab-charts"' in page and 'id="tab-config"' in page
    assert f'hx-get="/share/{link.token}/rollouts/"' in page
    assert f'href="/projects/{api_run.project_id}/' not in page  # nothing leads into the team's pages
    assert "Sign in" not in page
    data = _data(page)
    assert data["api"] == f"/api/shared/{link.token}" and data["share"] == link.token
    assert data["socket"] == f"/ws/runs/{api_run.pk}/"


def test_config_download_through_the_token(client: Client, member: Any, api_run: Run) -> None:
    link = ShareLink.create(api_run, member)
    response = client.get(f"/share/{link.token}/config.json")
    assert response.status_code == 200 and json.loads(response.content) == api_run.config


def test_revoked_and_unknown_tokens_are_404(client: Client, member: Any, run: Run) -> None:
    link = ShareLink.create(run, member)
    ShareLink.objects.filter(pk=link.pk).update(revoked_at=timezone.now())
    assert client.get(f"/share/{link.token}/").status_code == 404
    assert client.get(f"/share/{link.token}/config.json").status_code == 404
    assert client.get("/share/not-a-token/").status_code == 404


def test_the_token_opens_nothing_else(
    client: Client, member: Any, run: Run, make_run: Callable[..., Run]
) -> None:
    other = make_run(name="other")
    link = ShareLink.create(run, member)
    client.get(f"/share/{link.token}/")
    # No session was created: the team's pages and the other run stay closed.
    assert client.get(f"/runs/{run.pk}/").status_code == 302
    assert client.get(f"/runs/{other.pk}/").status_code == 302
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 302
    run.refresh_from_db()
    assert run.status == "queued"


def test_parent_and_logs_stay_private(client: Client, member: Any, make_run: Callable[..., Run]) -> None:
    parent = make_run(name="secret-parent")
    run = make_run(name="child", parent=parent, parent_kind="fork")
    LogLine.objects.create(run=run, seq=1, level="info", message="private log line", time=timezone.now())
    page = client.get(f"/share/{ShareLink.create(run, member).token}/").content.decode()
    assert f'href="/runs/{parent.pk}/"' not in page and "private log line" not in page


def test_shared_text_is_escaped(client: Client, member: Any, make_run: Callable[..., Run]) -> None:
    run = make_run(name="<img src=x onerror=alert(1)>", notes="<b>bold</b>")
    page = client.get(f"/share/{ShareLink.create(run, member).token}/").content.decode()
    assert "<img src=x" not in page and "<b>bold</b>" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page
