"""The run page follows its run without a reload (issue 15): the header fragment the page swaps
in after each status change offers exactly the actions the state allows, the status line counts
steps from ``last_step``, a cancel request reaches open pages, and the compare page a run's
Compare button opens lets runs be added."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.live import announce
from webapp.runs.choices import RunStatus
from webapp.runs.models import Checkpoint, Run, ShareLink
from webapp.runs.services import request_cancel

ACTIONS = ("cancel-form", "resume-form", "fork-link", "compare-link")


def _header(client: Client, run: Run) -> str:
    response = client.get(f"/runs/{run.pk}/header/")
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    return response.content.decode()


def _actions(html: str) -> set[str]:
    return {a for a in ACTIONS if f'id="{a}"' in html}


def _set(run: Run, status: RunStatus, **fields: Any) -> Run:
    Run.objects.filter(pk=run.pk).update(status=status, **fields)
    run.refresh_from_db()
    return run


@pytest.mark.parametrize(
    ("status", "checkpoint", "cancel_requested", "actions"),
    [
        (RunStatus.QUEUED, False, False, {"cancel-form", "fork-link", "compare-link"}),
        (RunStatus.STARTING, False, False, {"cancel-form", "fork-link", "compare-link"}),
        (RunStatus.RUNNING, True, False, {"cancel-form", "fork-link", "compare-link"}),
        (RunStatus.RUNNING, True, True, {"fork-link", "compare-link"}),
        (RunStatus.SUCCEEDED, True, False, {"resume-form", "fork-link", "compare-link"}),
        (RunStatus.FAILED, False, False, {"fork-link", "compare-link"}),  # nothing to resume from
        (RunStatus.CANCELLED, True, True, {"resume-form", "fork-link", "compare-link"}),
        (RunStatus.LOST, True, False, {"resume-form", "fork-link", "compare-link"}),
    ],
)
def test_the_header_fragment_offers_the_actions_of_the_state(
    client_for: Callable[..., Client],
    member: Any,
    api_run: Run,
    status: RunStatus,
    checkpoint: bool,
    cancel_requested: bool,
    actions: set[str],
) -> None:
    _set(api_run, status, cancel_requested_at=timezone.now() if cancel_requested else None)
    if checkpoint:
        Checkpoint.objects.create(run=api_run, seq=3, step=2, path="/ckpt/step-2", bytes=10)
    html = _header(client_for(member), api_run)
    assert html.lstrip().startswith("<header") and 'id="run-header"' in html
    assert f'data-status="{status.value}"' in html
    assert _actions(html) == actions
    # The note a cancel request leaves lasts only while the run is still active.
    assert ('id="run-cancelling"' in html) == (cancel_requested and not status.is_final)
    assert ('id="live-state"' in html) == (not status.is_final)
    # The Checkpoints tab's count comes along (htmx swaps it out of band).
    count = 1 if checkpoint else 0
    assert f'<span class="muted" id="checkpoint-count" hx-swap-oob="true">{count}</span>' in html
    # The fragment swaps itself again on the next change, with the page's own URL.
    assert f'data-refresh="/runs/{api_run.pk}/header/"' in html


def test_the_page_renders_the_same_header(
    client_for: Callable[..., Client], member: Any, api_run: Run
) -> None:
    client = client_for(member)
    page = client.get(f"/runs/{api_run.pk}/").content.decode()
    fragment = _header(client, api_run)
    strip = re.compile(r'name="csrfmiddlewaretoken" value="[^"]*"')
    header = fragment[: fragment.index("</header>") + len("</header>")]
    assert strip.sub("", header).strip() in strip.sub("", page)
    assert "hx-swap-oob" not in page  # the page's own tab holds the count


def test_a_viewer_gets_no_actions_and_outsiders_a_404(
    client_for: Callable[..., Client], viewer: Any, outsider: Any, api_run: Run
) -> None:
    assert _actions(_header(client_for(viewer), api_run)) == set()
    assert client_for(outsider).get(f"/runs/{api_run.pk}/header/").status_code == 404
    anonymous = client_for(None).get(f"/runs/{api_run.pk}/header/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
    assert client_for(viewer).post(f"/runs/{api_run.pk}/header/").status_code == 405


def test_the_share_link_header_is_read_only_and_dies_with_the_link(
    client: Client, member: Any, api_run: Run
) -> None:
    link = ShareLink.create(api_run, member)
    response = client.get(f"/share/{link.token}/header/")
    assert response.status_code == 200
    html = response.content.decode()
    assert _actions(html) == set() and 'id="run-actions"' not in html
    assert 'id="checkpoint-count"' not in html  # the shared page has no Checkpoints tab
    assert f'data-refresh="/share/{link.token}/header/"' in html
    link.revoked_at = timezone.now()
    link.save(update_fields=["revoked_at"])
    assert client.get(f"/share/{link.token}/header/").status_code == 404


def test_the_status_line_counts_steps_from_last_step(
    client_for: Callable[..., Client], member: Any, api_run: Run
) -> None:
    _set(api_run, RunStatus.RUNNING, status_message="training on cpu", last_step=30)
    html = _header(client_for(member), api_run)
    line = re.search(r'<p id="run-alert"[^>]*>(.*?)</p>', html, re.S)
    assert line, html
    text = re.sub(r"<[^>]+>", "", line.group(1))
    assert text == "training on cpu · step 30 of 50"
    assert "<span data-live-step>30</span>" in line.group(1)  # run.js follows it live
    # Not while queued or once final: no step to count there.
    _set(api_run, RunStatus.SUCCEEDED, status_message="finished 50 steps", last_step=50)
    html = _header(client_for(member), api_run)
    assert "data-live-step" not in html and ">finished 50 steps</p>" in html


def test_a_cancel_request_is_announced_to_open_pages(
    api_run: Run, monkeypatch: pytest.MonkeyPatch, django_capture_on_commit_callbacks: Any
) -> None:
    _set(api_run, RunStatus.RUNNING, worker_host="w1")
    sent: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(announce, "send", lambda group, message: sent.append((group, message)))
    with django_capture_on_commit_callbacks(execute=True):
        request_cancel(api_run, "cancelled by member")
    kinds = [message["type"] for _, message in sent]
    assert "ingest.cancel" in kinds  # the worker is told
    statuses = [message for _, message in sent if message["type"] == "run.status"]
    assert statuses and statuses[0]["status"] == "running"  # and the pages, which read the header again


# --- compare ---------------------------------------------------------------------------------


def test_the_run_page_compare_button_leads_to_a_page_that_can_add(
    client_for: Callable[..., Client], member: Any, api_run: Run, make_run: Callable[..., Run]
) -> None:
    client = client_for(member)
    other = make_run(name="second")
    href = re.search(r'id="compare-link" href="([^"]+)"', _header(client, api_run)).group(1)
    assert href == f"/compare/?runs={api_run.pk}"
    page = client.get(href).content.decode()
    assert 'id="compare-search"' in page and 'id="compare-one"' in page
    found = client.get("/compare/search.json", {"q": "", "exclude": str(api_run.pk)}).json()["runs"]
    assert [r["id"] for r in found] == [other.pk]  # the run shown is not offered again
