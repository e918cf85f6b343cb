"""The run page: who sees what, the actions members may take, escaping, empty and error states."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import yaml
from django.test import Client
from django.utils import timezone

from webapp.runs.choices import RunStatus
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, ShareLink


def _page(client: Client, run: Run) -> str:
    response = client.get(f"/runs/{run.pk}/")
    assert response.status_code == 200
    return response.content.decode()


def _data(page: str) -> dict[str, Any]:
    match = re.search(r'<script id="run-data" type="application/json">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


@pytest.fixture
def finished_run(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> Run:
    run = make_run(config=valid_config, name="finished", tags=["baseline"])
    now = timezone.now()
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.FAILED,
        status_message="CUDA out of memory",
        started_at=now - timedelta(minutes=5),
        finished_at=now,
        worker_host="gpu-7",
        last_step=12,
        last_seq=40,
    )
    Checkpoint.objects.create(run=run, seq=10, step=5, path="/ckpt/step-5/model", bytes=2048)
    Checkpoint.objects.create(run=run, seq=30, step=10, path="/ckpt/step-10/model", bytes=4096)
    run.refresh_from_db()
    return run


# --- who sees the page ----------------------------------------------------------------------


def test_sign_in_needed(client: Client, run: Run) -> None:
    response = client.get(f"/runs/{run.pk}/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_outsider_and_unknown_run_are_404(client_for: Callable[..., Client], outsider: Any, run: Run) -> None:
    client = client_for(outsider)
    assert client.get(f"/runs/{run.pk}/").status_code == 404
    assert client.get(f"/runs/{run.pk + 1000}/").status_code == 404
    assert client.get(f"/runs/{run.pk}/config.json").status_code == 404
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 404
    assert client.post(f"/runs/{run.pk}/meta/", {"tags": "x"}).status_code == 404


def test_member_sees_header_actions_and_tabs(
    client_for: Callable[..., Client], member: Any, api_run: Run
) -> None:
    page = _page(client_for(member), api_run)
    assert 'id="run-status"' in page and 'data-status="queued"' in page
    assert 'id="run-total">50<' in page  # trainer.total_steps
    assert 'id="cancel-form"' in page and "hx-confirm=" in page
    assert f'href="/projects/{api_run.project_id}/new/?from={api_run.pk}"' in page
    assert 'id="meta-form"' in page and 'id="share-create"' in page
    assert f'hx-get="/runs/{api_run.pk}/rollouts/" hx-trigger="intersect once"' in page
    for tab in ("charts", "rollouts", "config", "logs", "checkpoints"):
        assert f'id="tab-{tab}"' in page and f'id="panel-{tab}"' in page
    assert 'id="resume-form"' not in page  # still queued: nothing to resume yet
    data = _data(page)
    assert data["api"] == f"/api/runs/{api_run.pk}" and data["socket"] == f"/ws/runs/{api_run.pk}/"
    assert data["share"] == "" and data["run"]["total_steps"] == 50 and data["run"]["is_final"] is False
    assert data["metric_names"] == []  # nothing logged yet
    for name in ("reward/mean", "actor/entropy"):
        MetricPoint.objects.create(run=api_run, name=name, step=1, value=0.5, time=timezone.now(), seq=1)
    # The page fetches its first panel's history on its own: it needs every name up front.
    assert _data(_page(client_for(member), api_run))["metric_names"] == ["actor/entropy", "reward/mean"]
    assert '<script type="module" src="/static/tributary/run.js">' in page  # it imports uPlot itself


def test_viewer_sees_no_actions_and_every_post_is_403(
    client_for: Callable[..., Client], viewer: Any, finished_run: Run
) -> None:
    client = client_for(viewer)
    page = _page(client, finished_run)
    for marker in ("cancel-form", "resume-form", "fork-link", "meta-form", "share-create", 'id="shares"'):
        assert marker not in page
    assert "CUDA out of memory" in page  # the state is visible to everyone who sees the run
    pk = finished_run.pk
    link = ShareLink.create(finished_run, None)
    for url in (
        f"/runs/{pk}/cancel/",
        f"/runs/{pk}/resume/",
        f"/runs/{pk}/meta/",
        f"/runs/{pk}/shares/",
        f"/runs/{pk}/shares/{link.pk}/revoke/",
    ):
        assert client.post(url, {"tags": "hacked", "notes": "x"}).status_code == 403, url
    finished_run.refresh_from_db()
    assert finished_run.tags == ["baseline"] and finished_run.notes == ""
    assert ShareLink.objects.filter(run=finished_run).count() == 1
    assert Run.objects.count() == 1


def test_a_get_on_an_action_is_refused(client_for: Callable[..., Client], member: Any, run: Run) -> None:
    assert client_for(member).get(f"/runs/{run.pk}/cancel/").status_code == 405


# --- header, states ---------------------------------------------------------------------------


def test_failed_run_shows_its_message_lineage_and_resume(
    client_for: Callable[..., Client], member: Any, finished_run: Run, make_run: Callable[..., Run]
) -> None:
    child = make_run(name="the-child", parent=finished_run, parent_kind="fork")
    page = _page(client_for(member), finished_run)
    assert 'class="badge danger"' in page
    assert re.search(r'id="run-alert" class="run-alert error" role="alert"[^>]*>CUDA out of memory<', page)
    assert "gpu-7" in page and 'id="run-step" data-step="12">12<' in page
    assert 'id="resume-form"' in page and 'value="latest" selected' in page
    ckpts = list(finished_run.checkpoints.order_by("step"))
    assert f'<option value="{ckpts[0].pk}">step 5 (saved ' in page
    assert "/ckpt/" not in page  # a checkpoint is named by its step, never by its path on the worker
    assert 'id="cancel-form"' not in page and 'id="live-state"' not in page
    assert f'href="/runs/{child.pk}/"' in page
    child_page = _page(client_for(member), child)
    assert f'href="/runs/{finished_run.pk}/" id="run-parent"' in child_page and "Forked from" in child_page
    assert _data(page)["run"]["is_final"] is True


def test_lost_run_shows_the_worker_state(client_for: Callable[..., Client], viewer: Any, run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(status=RunStatus.LOST, status_message="the worker went silent")
    page = _page(client_for(viewer), run)
    assert 'class="badge warning"' in page and "the worker went silent" in page


def test_empty_states(client_for: Callable[..., Client], viewer: Any, run: Run) -> None:
    page = _page(client_for(viewer), run)
    assert "No log lines yet." in page and "No checkpoints yet." in page
    assert 'id="charts-state"' in page and 'id="charts"' in page and 'data-points="0"' in page
    assert 'id="run-alert"' in page and re.search(r'id="run-alert"[^>]*hidden', page)
    assert "no tags" in page and "No notes." in page


def test_config_yaml_and_json_download(client_for: Callable[..., Client], viewer: Any, api_run: Run) -> None:
    client = client_for(viewer)
    page = _page(client, api_run)
    match = re.search(r'<pre class="config-yaml"[^>]*>(.*?)</pre>', page, re.S)
    assert match
    import html

    assert yaml.safe_load(html.unescape(match.group(1))) == api_run.config
    download = client.get(f"/runs/{api_run.pk}/config.json")
    assert download.status_code == 200 and "attachment" in download["Content-Disposition"]
    assert json.loads(download.content) == api_run.config


def test_logs_and_checkpoints_tables(
    client_for: Callable[..., Client], viewer: Any, finished_run: Run
) -> None:
    now = timezone.now()
    LogLine.objects.create(run=finished_run, seq=5, level="warning", message="loss spiked", time=now)
    LogLine.objects.create(run=finished_run, seq=6, level="error", message="OOM", time=now)
    page = _page(client_for(viewer), finished_run)
    assert 'data-seq="5" data-level="warning"' in page and "loss spiked" in page
    assert 'id="log-level"' in page
    assert 'data-seq="' in page and "4.0\xa0KB" in page
    assert "/ckpt/" not in page  # where the worker keeps it is no business of a page (the API has it)
    assert 'id="checkpoint-count">2<' in page


# --- escaping ----------------------------------------------------------------------------------


def test_user_text_is_escaped(
    client_for: Callable[..., Client], member: Any, make_run: Callable[..., Run]
) -> None:
    evil = "<script>alert(1)</script>"
    run = make_run(name=evil, tags=[evil], notes=evil, status_message=evil)
    LogLine.objects.create(run=run, seq=1, level="info", message=evil, time=timezone.now())
    page = _page(client_for(member), run)
    assert evil not in page.replace(  # the page's own scripts are the only <script> tags
        '<script id="run-data" type="application/json">', ""
    )
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    data = _data(page)  # json_script escapes < > & inside the JSON
    assert data["run"]["name"] == evil


# --- actions -------------------------------------------------------------------------------------


def test_member_cancels_a_queued_run(client_for: Callable[..., Client], member: Any, run: Run) -> None:
    client = client_for(member)
    response = client.post(f"/runs/{run.pk}/cancel/")
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and "bob-member" in run.status_message
    again = client.post(f"/runs/{run.pk}/cancel/", follow=True)
    assert "already cancelled" in again.content.decode()


def test_cancel_through_htmx_answers_the_fresh_header(
    client_for: Callable[..., Client], member: Any, run: Run
) -> None:
    client = client_for(member)
    response = client.post(f"/runs/{run.pk}/cancel/", HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200 and html.lstrip().startswith("<header")
    assert 'data-status="cancelled"' in html and 'id="cancel-form"' not in html
    again = client.post(f"/runs/{run.pk}/cancel/", HTTP_HX_REQUEST="true").content.decode()
    assert 'id="run-action-error"' in again and "already cancelled" in again


def test_resume_from_a_chosen_checkpoint_continues_the_same_run(
    client_for: Callable[..., Client], member: Any, finished_run: Run
) -> None:
    first = finished_run.checkpoints.order_by("step").first()
    response = client_for(member).post(f"/runs/{finished_run.pk}/resume/", {"checkpoint": str(first.pk)})
    assert response.status_code == 302 and response["Location"] == f"/runs/{finished_run.pk}/"
    assert not Run.objects.exclude(pk=finished_run.pk).exists()
    run = Run.objects.get(pk=finished_run.pk)
    assert (run.status, run.resume_from_id, run.attempt_number) == ("queued", first.pk, 2)


def test_resume_from_the_latest_by_default(
    client_for: Callable[..., Client], member: Any, finished_run: Run
) -> None:
    client_for(member).post(f"/runs/{finished_run.pk}/resume/", {"checkpoint": "latest"})
    assert Run.objects.get(pk=finished_run.pk).resume_from.step == 10


def test_resume_with_htmx_swaps_the_header_and_lists_the_new_attempt(
    client_for: Callable[..., Client], member: Any, finished_run: Run
) -> None:
    """The page stays (its charts and socket go on): the answer is the header, with the attempts
    list beside it for an out-of-band swap."""
    client = client_for(member)
    page = client.get(f"/runs/{finished_run.pk}/").content.decode()
    assert 'id="run-attempts"' in page and 'data-count="1"' in page
    # The resume form offers the checkpoints by step, newest first.
    steps = re.findall(r'<option value="\d+">step (\d+) ', page)
    assert steps == sorted(steps, key=int, reverse=True) and len(steps) == finished_run.checkpoints.count()
    html = client.post(f"/runs/{finished_run.pk}/resume/", {"checkpoint": "latest"}, HTTP_HX_REQUEST="true")
    html = html.content.decode()
    assert html.lstrip().startswith("<header") and 'data-status="queued"' in html
    assert 'id="run-attempts"' in html and 'hx-swap-oob="true"' in html and 'data-count="2"' in html
    assert 'data-attempt="2"' in html and "from the checkpoint of step 10" in html
    again = client.post(f"/runs/{finished_run.pk}/resume/", HTTP_HX_REQUEST="true").content.decode()
    assert 'id="run-action-error"' in again and "cancel it first" in again


def test_resume_refusals_are_messages(
    client_for: Callable[..., Client], member: Any, finished_run: Run, run: Run
) -> None:
    client = client_for(member)
    page = client.post(
        f"/runs/{finished_run.pk}/resume/", {"checkpoint": "999999"}, follow=True
    ).content.decode()
    assert "has no checkpoint 999999" in page
    page = client.post(f"/runs/{run.pk}/resume/", follow=True).content.decode()
    assert "Cannot resume" in page and "cancel it first" in page
    assert Run.objects.count() == 2


def test_tags_and_notes_with_htmx(client_for: Callable[..., Client], member: Any, run: Run) -> None:
    client = client_for(member)
    response = client.post(
        f"/runs/{run.pk}/meta/", {"tags": " a, b ,a,, <b>", "notes": "n & <i>"}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    fragment = response.content.decode()
    assert fragment.lstrip().startswith('<div id="run-meta">') and "Saved." in fragment
    assert 'value="a, b, &lt;b&gt;"' in fragment and "n &amp; &lt;i&gt;" in fragment
    run.refresh_from_db()
    assert run.tags == ["a", "b", "<b>"] and run.notes == "n & <i>"
    bad = client.post(f"/runs/{run.pk}/meta/", {"tags": "x" * 60, "notes": "kept"}, HTTP_HX_REQUEST="true")
    assert bad.status_code == 422 and "each tag must be 1-50 characters" in bad.content.decode()
    run.refresh_from_db()
    assert run.tags == ["a", "b", "<b>"] and run.notes == "n & <i>"


def test_tags_and_notes_without_htmx(client_for: Callable[..., Client], member: Any, run: Run) -> None:
    response = client_for(member).post(f"/runs/{run.pk}/meta/", {"tags": "x,y", "notes": "hello"})
    assert response.status_code == 302
    run.refresh_from_db()
    assert run.tags == ["x", "y"] and run.notes == "hello"


def test_share_links_create_list_revoke(client_for: Callable[..., Client], member: Any, run: Run) -> None:
    client = client_for(member)
    created = client.post(f"/runs/{run.pk}/shares/", HTTP_HX_REQUEST="true")
    assert created.status_code == 200
    link = ShareLink.objects.get(run=run)
    fragment = created.content.decode()
    assert f'href="/share/{link.token}/"' in fragment and "copy-share" in fragment
    revoked = client.post(f"/runs/{run.pk}/shares/{link.pk}/revoke/", HTTP_HX_REQUEST="true")
    assert revoked.status_code == 200 and "revoked" in revoked.content.decode()
    link.refresh_from_db()
    assert link.revoked_at is not None
    assert client.get(f"/share/{link.token}/").status_code == 404
    assert client.post(f"/runs/{run.pk}/shares/{link.pk + 99}/revoke/").status_code == 404
    page = _page(client, run)
    assert f'<s class="muted">/share/{link.token}/</s>' in page


def test_a_share_link_of_another_run_cannot_be_revoked_through_this_one(
    client_for: Callable[..., Client], member: Any, run: Run, make_run: Callable[..., Run]
) -> None:
    other = make_run(name="other")
    link = ShareLink.create(other, member)
    assert client_for(member).post(f"/runs/{run.pk}/shares/{link.pk}/revoke/").status_code == 404
    link.refresh_from_db()
    assert link.revoked_at is None


def test_metrics_are_left_to_the_api(client_for: Callable[..., Client], viewer: Any, run: Run) -> None:
    """The page renders the frame; the charts read /api/runs/<id>/metrics/series (same data)."""
    MetricPoint.objects.create(run=run, name="reward/mean", step=1, value=0.5, time=timezone.now(), seq=1)
    client = client_for(viewer)
    page = _page(client, run)
    series = client.get(f"/api/runs/{run.pk}/metrics/series?max_points=1000&x=step").json()
    assert _data(page)["api"] == f"/api/runs/{run.pk}"
    assert series["series"][0]["name"] == "reward/mean" and series["series"][0]["value"] == [0.5]
