"""Self-service accounts and teams in a real browser against the real server (issue 15).

A deployment without a worker. The team's admin makes an invite link on the team page; a new
visitor in a second browser context opens it, makes an account and lands in the team, which the
admin then sees in the members list, and the used link says so when opened again. On a finished
run (metrics, samples, a log line and a checkpoint stored through the ingest path, and files in
its run directory) the admin renames it inline (an empty name is refused at the field), archives
it (the runs table hides it; its "Archived runs only" filter shows it), restores it, and deletes
it after typing its name: the rows and the run directory are gone. At 1440 and 390 px, with
screenshots in .cache/artifacts/screenshots and no console errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser import (
    NARROW,
    WIDE,
    Site,
    new_context,
    no_errors,
    running_site,
    screenshot,
    signed_in_page,
    wider_than_the_window,
)

pytestmark = pytest.mark.slow

NEW_PASSWORD = "estuary-mouth-9931"

# A finished run as a worker would leave it: its events stored through the ingest path, and
# files in its run directory (the deployment's data dir: embedded mode reaches them).
SEED = """
import json, time
from django.contrib.auth import get_user_model
from jobs.supervisor import runs_dir
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
user = get_user_model().objects.get(username="e2e")
run = Run.objects.create(project_id={project}, created_by=user, name={name!r}, config={{"name": {name!r}}})
workdir = runs_dir() / str(run.pk)
(workdir / "checkpoints" / "step_3").mkdir(parents=True)
(workdir / "checkpoints" / "step_3" / "model.safetensors").write_bytes(b"0" * 4096)
t0 = time.time() - 100
events = [{{"type": "status", "state": "starting"}}, {{"type": "status", "state": "running"}}]
for step in range(1, 4):
    events.append({{"type": "metrics", "step": step, "time": t0 + step, "values": {{"reward/mean": step / 4}}}})
events.append({{"type": "samples", "step": 3, "items": [{{"prompt": "2+2?", "completion": "4", "reward": 1.0,
    "advantage": 0.5, "length": 1, "finish_reason": "stop", "extra": {{}}}}]}})
events.append({{"type": "log", "level": "info", "message": "saved"}})
events.append({{"type": "checkpoint", "step": 3, "path": str(workdir / "checkpoints" / "step_3"), "bytes": 4096}})
events.append({{"type": "status", "state": "succeeded", "message": "done"}})
for seq, event in enumerate(events, 1):
    event.update(run=str(run.pk), seq=seq)
store_events(run.pk, events)
print(json.dumps({{"run": run.pk, "workdir": str(workdir)}}))
"""

COUNT_ROWS = """
import json
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample
run_id = {run}
print(json.dumps([m.objects.filter(**({{"pk": run_id}} if m is Run else {{"run_id": run_id}})).count()
                  for m in (Run, MetricPoint, Sample, LogLine, Checkpoint)]))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with running_site(tmp_path_factory.mktemp("housekeeping-site"), worker=False) as s:
        yield s


def _shell_json(site: Site, code: str) -> Any:
    return json.loads(site.deployment.manage("shell", "-c", code).strip().splitlines()[-1])


def _fits(page: Any) -> None:
    """No sideways scrolling at this width."""
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1, f"the page is {overflow} px wider than the window: {wider_than_the_window(page)}"


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_an_invite_is_made_accepted_by_a_new_user_and_used_once(
    site: Site, browser: Any, viewport: dict[str, int]
) -> None:
    size = f"{viewport['width']}px"
    newcomer = f"newcomer-{size}"
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/teams/{site.team}/")
    page.select_option("#id_role", "member")
    page.fill("#id_note", f"{newcomer}@example.com")
    page.fill("#id_days", "3")
    page.click("#invite-create")
    page.wait_for_selector("#new-invite-url")
    link = page.input_value("#new-invite-url")
    assert link.startswith(f"{site.url}/invites/")
    assert page.locator("#invite-table tr", has_text=f"{newcomer}@example.com").count() == 1
    _fits(page)
    screenshot(page, "housekeeping-invite", f"made-{size}")

    # A second browser: nobody signed in.
    guest, guest_console = new_context(browser, viewport)
    visitor = guest.new_page()
    visitor.goto(link)
    assert "Join E2E" in visitor.inner_text("h1")
    visitor.fill("#id_username", newcomer)
    visitor.fill("#id_password1", "password")  # too common: Django's validators say so
    visitor.fill("#id_password2", "password")
    visitor.click("#signup-submit")
    visitor.wait_for_selector("#error-signup-password2")
    assert "too common" in visitor.inner_text("#error-signup-password2")
    _fits(visitor)
    screenshot(visitor, "housekeeping-invite", f"signup-refused-{size}")
    visitor.fill("#id_password1", NEW_PASSWORD)
    visitor.fill("#id_password2", NEW_PASSWORD)
    visitor.click("#signup-submit")
    visitor.wait_for_url(f"{site.url}/teams/{site.team}/")
    assert "you are member" in visitor.inner_text("#team-name")
    assert visitor.locator(f'#member-table tr[data-username="{newcomer}"]').count() == 1
    assert visitor.locator("#invite-form").count() == 0  # a member makes no invites
    _fits(visitor)
    screenshot(visitor, "housekeeping-invite", f"joined-{size}")
    visitor.goto(f"{site.url}/")  # the landing page lists the new team
    assert visitor.locator(f'a[href="/teams/{site.team}/"]').count() == 1

    # The admin sees the new member; the link is no longer pending, and says it was used.
    page.goto(f"{site.url}/teams/{site.team}/")
    assert page.locator(f'#member-table tr[data-username="{newcomer}"][data-role="member"]').count() == 1
    assert page.locator("#invite-table tr", has_text=f"{newcomer}@example.com").count() == 0
    third, third_console = new_context(browser, viewport)
    late = third.new_page()
    late.goto(link)
    assert "already used" in late.inner_text("#invite-refused")
    screenshot(late, "housekeeping-invite", f"used-{size}")
    guest_console.allowed.append("status of 400")  # the refused password's page, as it should
    third_console.allowed.append("status of 410")  # the used link's page answers 410 Gone
    for c in (console, guest_console, third_console):
        no_errors(c)
    for ctx in (context, guest, third):
        ctx.close()


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_rename_archive_restore_and_delete_a_run(site: Site, browser: Any, viewport: dict[str, int]) -> None:
    size = f"{viewport['width']}px"
    seeded = _shell_json(site, SEED.format(project=site.project, name=f"baseline-{size}"))
    run_id, workdir = seeded["run"], Path(seeded["workdir"])
    assert (workdir / "checkpoints" / "step_3" / "model.safetensors").exists()
    context, page, console = signed_in_page(browser, site, "e2e", viewport, f"/runs/{run_id}/")

    # Rename inline: an empty name is refused at the field, then a good one is saved in place.
    page.click("#rename-toggle")
    page.fill("#run-name-input", "   ")
    page.click("#rename-save")
    page.wait_for_selector("#rename-error")
    assert page.inner_text("#rename-error").startswith("name: give the run a name")
    screenshot(page, "housekeeping-run", f"rename-refused-{size}", full_page=False)
    new_name = f"grpo-lr3e-6-{size}"
    page.fill("#run-name-input", new_name)
    page.click("#rename-save")
    page.wait_for_selector("#rename-saved")
    assert page.inner_text("#run-title").startswith(new_name)
    assert page.title() == f"{new_name} · Tributary"
    _fits(page)
    screenshot(page, "housekeeping-run", f"renamed-{size}", full_page=False)

    # Archive: the runs table hides it; its filter shows it; Restore brings it back.
    page.click("#archive-button")
    page.wait_for_selector("#run-archived")
    page.goto(f"{site.url}/projects/{site.project}/")
    assert page.locator(f"#run-row-{run_id}").count() == 0
    page.check("#filter-archived")
    page.wait_for_selector(f"#run-row-{run_id}")
    assert new_name in page.inner_text(f"#run-row-{run_id}")
    _fits(page)
    screenshot(page, "housekeeping-run", f"archived-filter-{size}")
    page.click(f"#run-row-{run_id} .run-name a")
    page.wait_for_url(f"{site.url}/runs/{run_id}/")
    page.click("#restore-button")
    page.wait_for_selector("#archive-button")
    assert page.locator("#run-archived").count() == 0
    page.goto(f"{site.url}/projects/{site.project}/")
    page.wait_for_selector(f"#run-row-{run_id}")

    # Delete: the confirmation page lists what goes; a wrong name is refused at the field.
    page.goto(f"{site.url}/runs/{run_id}/")
    page.click("#delete-link")
    page.wait_for_url(f"{site.url}/runs/{run_id}/delete/")
    holdings = page.inner_text("#delete-holdings")
    assert "3 metric points" in holdings and "1 sample" in holdings and "1 checkpoint" in holdings
    page.fill("#delete-confirm", "baseline")
    page.click("#delete-submit")
    page.wait_for_selector("#error-confirm")
    assert "type the run's name exactly" in page.inner_text("#error-confirm")
    _fits(page)
    screenshot(page, "housekeeping-run", f"delete-confirm-{size}")
    page.fill("#delete-confirm", new_name)
    page.click("#delete-submit")
    page.wait_for_url(f"{site.url}/projects/{site.project}/")
    assert f"Run {new_name} was deleted" in page.inner_text(".messages")
    assert page.locator(f"#run-row-{run_id}").count() == 0
    screenshot(page, "housekeeping-run", f"deleted-{size}")
    assert _shell_json(site, COUNT_ROWS.format(run=run_id)) == [0, 0, 0, 0, 0]
    assert not workdir.exists()
    console.allowed.append("status of 400")  # the refused name's page answers 400, as it should
    no_errors(console)
    context.close()


@pytest.mark.parametrize("viewport", [WIDE, NARROW], ids=["1440px", "390px"])
def test_a_team_is_made_renamed_and_its_project_renamed_archived_and_restored(
    site: Site, browser: Any, viewport: dict[str, int]
) -> None:
    """Team administration without Django admin: from the landing page a user makes a team (an
    empty name is refused at the field) and is its admin, renames it, makes a project, renames
    it, archives it (it leaves the team's list for the archived list) and restores it."""
    size = f"{viewport['width']}px"
    context, page, console = signed_in_page(browser, site, "e2e", viewport, "/")
    page.click("#new-team")
    page.wait_for_selector("#team-new-form")
    page.click("#team-create")  # no name
    page.wait_for_selector("#error-team-name")
    assert "Give the team a name" in page.inner_text("#error-team-name")
    page.fill("#team-new-form input[name=name]", f"Lab {size}")
    page.click("#team-create")
    page.wait_for_selector("#team-name")
    assert page.inner_text("#team-name").startswith(f"Lab {size}")
    assert "you are admin" in page.inner_text("#team-name")
    team_url = page.url

    page.click("#team-admin summary")
    page.fill("#team-rename-form input[name=name]", f"Reasoning {size}")
    page.click("#team-rename")
    page.wait_for_function(
        "name => (document.querySelector('#team-name')?.textContent ?? '').startsWith(name)",
        arg=f"Reasoning {size}",
    )
    _fits(page)
    screenshot(page, "housekeeping-team", f"renamed-{size}")

    page.fill("#project-create-form input[name=name]", f"Sweep {size}")
    page.click("#project-create")
    page.wait_for_selector("#project-name")
    assert page.inner_text("#project-name").startswith(f"Sweep {size}")
    project_url = page.url
    page.click("#project-admin summary")
    page.fill("#project-name-input", f"Sweep v2 {size}")
    page.click("#project-rename")
    page.wait_for_function(
        "name => (document.querySelector('#project-name')?.textContent ?? '').startsWith(name)",
        arg=f"Sweep v2 {size}",
    )
    page.click("#project-admin summary")
    page.click("#project-archive")
    page.wait_for_url(team_url)
    assert page.locator("#project-list li").count() == 0
    page.click("#archived-projects-link")
    page.wait_for_selector("#archived-list")
    assert page.locator("#archived-list li", has_text=f"Sweep v2 {size}").count() == 1
    _fits(page)
    screenshot(page, "housekeeping-team", f"archived-{size}")
    page.click(f"#archived-list button[aria-label='Restore Sweep v2 {size}']")
    page.wait_for_selector("#project-name")
    assert page.url == project_url and page.locator("#project-archived").count() == 0
    page.goto(team_url)
    assert page.locator("#project-list li", has_text=f"Sweep v2 {size}").count() == 1
    assert page.locator("#archived-projects-link").count() == 0
    console.allowed.append("status of 400")  # the refused empty name's page, as it should
    no_errors(console)
    context.close()
