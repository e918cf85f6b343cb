"""Small things a user notices on the server-rendered pages (issue 15): the launch form's error
summary counts the errors it lists, and rollout cards are coloured by where their reward falls
in the run's range. The browser side is tests/e2e/test_browser_small_things.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.webapp.test_pages_launch import form_data
from tests.webapp.test_pages_rollouts import add_samples
from webapp.runs.models import Run
from webapp.teams.models import Project


@pytest.fixture
def member_client(member: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(member)


def summary(html: str) -> tuple[str, int, list[str]]:
    """The error summary's heading, its data-count and its lines."""
    block = re.search(r'<div id="error-summary".*?</ul>', html, re.S)
    assert block, "no error summary"
    heading = re.search(r"<h2>([^<]*)</h2>", block.group(0)).group(1)
    count = int(re.search(r'data-count="(\d+)"', block.group(0)).group(1))
    return heading, count, re.findall(r"<li[ >].*?</li>", block.group(0), re.S)


# --- the launch form's error summary ----------------------------------------------------------


def test_the_summary_counts_field_and_launch_errors(member_client: Client, project: Project) -> None:
    url = f"/projects/{project.pk}/new/"
    page = member_client.get(url).content.decode()
    data = form_data(page, **{"rollout.n": "0", "optimizer.lr": "-1", "queue": "bad queue!"})
    response = member_client.post(url, data)
    assert response.status_code == 422 and not Run.objects.exists()
    html = response.content.decode()
    heading, count, lines = summary(html)
    # Three errors on the page (two config fields, the queue), three lines, "Fix 3 problems".
    assert html.count('class="error field-error"') == 3
    assert heading == "Fix 3 problems before launching"
    assert count == len(lines) == 3
    assert any('href="#f-queue"' in line and "not a queue name" in line for line in lines)
    assert any('href="#f-rollout-n"' in line for line in lines)


def test_a_yaml_error_is_one_problem_in_the_summary(member_client: Client, project: Project) -> None:
    url = f"/projects/{project.pk}/new/"
    response = member_client.post(
        url, {"_mode": "yaml", "config_yaml": "rollout: [1,\n", "_action": "launch"}
    )
    assert response.status_code == 422
    heading, count, lines = summary(response.content.decode())
    assert heading == "Fix 1 problem before launching" and count == 1
    assert 'href="#config-yaml"' in lines[0] and "YAML syntax error" in lines[0]


def test_a_general_problem_and_a_field_problem_make_two(member_client: Client, project: Project) -> None:
    yaml_text = "name: x\nrollout:\n  n: 0\n  typo_field: 3\n"
    response = member_client.post(f"/projects/{project.pk}/new/", {"_mode": "yaml", "config_yaml": yaml_text})
    heading, count, lines = summary(response.content.decode())
    assert count == len(lines) == 2, lines
    assert heading == "Fix 2 problems before launching"


# --- rollout cards coloured by reward ----------------------------------------------------------


def cards(html: str) -> dict[str, str]:
    """Each card's reward (as rendered in data-reward) -> its reward level ('' for none)."""
    return dict(re.findall(r'data-reward="([^"]*)" data-reward-level="([^"]*)"', html))


def rollouts_html(client: Client, run: Run, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return client.get(f"/runs/{run.pk}/rollouts/?{query}").content.decode()


def test_cards_are_coloured_by_where_the_reward_falls_in_the_run(member_client: Client, run: Run) -> None:
    rewards = [0.0, 0.25, 0.5, 1.0, None]
    add_samples(run, 1, [("What is 2+2?", [{"reward": r} for r in rewards])])
    html = rollouts_html(member_client, run, step="1")
    assert cards(html) == {"0.0": "0", "0.25": "1", "0.5": "2", "1.0": "4", "": ""}
    assert re.search(r'class="rollout failed"[^>]*data-reward="" data-reward-level=""', html)  # no colour
    # The number is printed on the colour, and the page says what the colours mean.
    assert "reward <strong>0.000</strong>" in html
    assert 'id="reward-scale" data-low="0.0" data-high="1.0"' in html


def test_the_range_is_the_runs_not_the_steps(member_client: Client, run: Run) -> None:
    add_samples(run, 1, [("p", [{"reward": -2.0}, {"reward": 8.0}])])
    add_samples(run, 2, [("p", [{"reward": 3.0}])])
    # At step 2 alone the reward 3 would be both the lowest and the highest: in the run it is mid-way.
    assert cards(rollouts_html(member_client, run, step="2")) == {"3.0": "2"}
    follow = re.search(r'data-follow="(\d+)"', rollouts_html(member_client, run, step="2")).group(1)
    assert cards(rollouts_html(member_client, run, follow=follow)) == {"-2.0": "0", "8.0": "4", "3.0": "2"}


def test_a_run_whose_rewards_are_all_equal_has_no_colours(member_client: Client, run: Run) -> None:
    add_samples(run, 1, [("p", [{"reward": 1.0}, {"reward": 1.0}])])
    html = rollouts_html(member_client, run)
    assert set(cards(html).values()) == {""}
    assert "not coloured by reward" in html and "reward-swatch" not in html
