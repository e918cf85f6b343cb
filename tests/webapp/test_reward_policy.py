"""Code execution is a deployment decision, not a launch field (engine/rewards/policy.py,
webapp.runs.queueing.reward_policy_for): through the API, the launch page and the broker."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tests.webapp.test_api_runs import launch, sent_task
from webapp.runs.models import Run
from webapp.teams.models import Project, Team

TIMEIT = {"reward": {"functions": [{"name": "timeit:timeit", "params": {"setup": "import os", "number": 1}}]}}
OWN = {"reward": {"functions": [{"name": "team_rewards.scoring:score"}]}}


def _refused(response: Any) -> str:
    assert response.status_code == 422, response.content
    (problem,) = response.json()["detail"]
    assert problem["loc"][-5:] == ["config", "reward", "functions", 0, "name"]
    return problem["msg"]


@pytest.mark.parametrize("who", ["member", "admin"])
def test_nobody_names_arbitrary_code_by_default(
    who: str, request: pytest.FixtureRequest, client_for: Callable[..., Client], project: Project
) -> None:
    client = client_for(request.getfixturevalue(who))
    for config in (TIMEIT, OWN):
        assert "not a registered reward function" in _refused(launch(client, project, {"config": config}))
    assert not Run.objects.exists()


def test_a_trusted_teams_admins_may_but_its_members_may_not(
    admin: Any, member: Any, team: Team, client_for: Callable[..., Client], project: Project,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    Team.objects.filter(pk=team.pk).update(allow_user_code=True)
    _refused(launch(client_for(member), project, {"config": OWN}))
    queue = f"policy-{timezone.now().timestamp():.0f}"
    with django_capture_on_commit_callbacks(execute=True):
        response = launch(client_for(admin), project, {"config": OWN, "queue": queue})
    assert response.status_code == 201, response.content
    _, kwargs = sent_task(queue)
    assert kwargs["user_code"] is True  # the worker confines it, or refuses to start it


def test_the_deployments_modules_are_open_to_members_and_need_no_trust(
    member: Any, client_for: Callable[..., Client], project: Project, monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    monkeypatch.setenv("TRIBUTARY_REWARD_MODULES", "team_rewards.scoring")
    queue = f"policy-mod-{timezone.now().timestamp():.0f}"
    with django_capture_on_commit_callbacks(execute=True):
        response = launch(client_for(member), project, {"config": OWN, "queue": queue})
    assert response.status_code == 201, response.content
    _, kwargs = sent_task(queue)
    assert kwargs["user_code"] is False
    _refused(launch(client_for(member), project, {"config": TIMEIT}))


def test_the_launch_page_says_the_same(
    member: Any, client_for: Callable[..., Client], project: Project
) -> None:
    yaml_text = "preset: grpo\nreward:\n  functions:\n    - name: timeit:timeit\n"
    response = client_for(member).post(f"/projects/{project.pk}/new/", {"_mode": "yaml", "config_yaml": yaml_text})
    assert response.status_code == 422
    assert "not a registered reward function" in response.content.decode()
    assert not Run.objects.exists()


def test_a_stage_naming_its_own_reward_code_is_marked_as_user_code() -> None:
    """``data.stages[].reward_functions`` names rewards as ``reward.functions`` does: a run whose
    only own code is a stage's must reach the worker marked, or the worker's engine refuses it."""
    from webapp.runs.queueing import runs_own_code

    stage = {"name": "b", "steps": 2, "reward_functions": [{"name": "mylab.rewards:score"}]}
    assert runs_own_code({"reward": {"functions": [{"name": "math"}]}, "data": {"stages": [stage]}})
    stage["reward_functions"] = [{"name": "math"}]
    assert not runs_own_code({"reward": {"functions": [{"name": "math"}]}, "data": {"stages": [stage]}})
