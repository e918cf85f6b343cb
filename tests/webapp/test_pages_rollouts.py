"""The rollout browser partial: steps, groups side by side, search, sort, follow, share links."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.runs.models import Run, Sample, ShareLink
from webapp.teams.models import Project

_seq = iter(range(1, 1_000_000))


def add_samples(run: Run, step: int, groups: list[tuple[str, list[dict[str, Any]]]]) -> list[Sample]:
    """One samples event of ``step``: each (prompt, [rollout fields]) becomes a group."""
    seq = next(_seq)
    out = []
    index = 0
    for g, (prompt, rollouts) in enumerate(groups):
        for fields in rollouts:
            fields = dict(fields)
            extra = fields.pop("extra", {"components": {"task": fields.get("reward") or 0.0}, "group": g})
            out.append(
                Sample.objects.create(
                    run=run,
                    step=step,
                    seq=seq,
                    index=index,
                    prompt=prompt,
                    completion=fields.pop("completion", f"answer {index}"),
                    reward=fields.pop("reward", 1.0),
                    advantage=fields.pop("advantage", 0.0),
                    length=fields.pop("length", 5),
                    finish_reason=fields.pop("finish_reason", "stop"),
                    extra=extra,
                )
            )
            index += 1
    return out


@pytest.fixture
def rollouts(run: Run) -> Run:
    add_samples(
        run,
        1,
        [
            (
                "What is 2+2?",
                [{"completion": "4", "reward": 1.0, "length": 2}, {"completion": "5", "reward": 0.0}],
            ),
            ("What is 3+3?", [{"completion": "6", "reward": 1.0}]),
        ],
    )
    add_samples(
        run,
        3,
        [
            (
                "What is 2+2?",
                [
                    {"completion": "four", "reward": 0.5, "advantage": 0.25, "length": 9},
                    {"completion": "4", "reward": 1.0, "advantage": 0.75, "length": 2},
                    {
                        "completion": "2+2 is " + "very " * 40,
                        "reward": 0.0,
                        "length": 24,
                        "finish_reason": "length",
                    },
                    {"completion": "boom", "reward": None, "extra": {"error": "reward timed out"}},
                ],
            ),
            ("What is 9+1?", [{"completion": "10", "reward": 0.2, "length": 3}]),
        ],
    )
    return run


def url(run: Run) -> str:
    return f"/runs/{run.pk}/rollouts/"


@pytest.fixture
def viewer_client(viewer: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(viewer)


def groups_of(html: str) -> list[str]:
    return re.findall(r'<pre class="prompt-text">([^<]*)</pre>', html)


def completions_of(html: str) -> list[str]:
    return re.findall(r'<pre class="completion">([^<]*)</pre>', html)


def test_team_members_see_the_partial_outsiders_404(run: Run, viewer: Any, outsider: Any) -> None:
    client = Client()
    client.force_login(viewer)
    response = client.get(url(run))
    assert response.status_code == 200
    html = response.content.decode()
    assert "<html" not in html and 'id="rollout-browser"' in html
    assert 'id="rollouts-empty"' in html  # no samples yet
    client.force_login(outsider)
    assert client.get(url(run)).status_code == 404
    assert client.get("/runs/999999/rollouts/").status_code == 404
    assert Client().get(url(run)).status_code == 302


def test_latest_step_grouped_by_prompt_side_by_side(viewer_client: Client, rollouts: Run) -> None:
    html = viewer_client.get(url(rollouts)).content.decode()
    assert 'data-step="3"' in html and 'id="rollout-latest-badge"' in html
    assert groups_of(html) == ["What is 2+2?", "What is 9+1?"]
    first = html.split('class="rollout-group')[1]
    assert first.count('<article class="rollout') == 4
    assert 'data-reward="0.5"' in first and "adv <strong>0.250</strong>" in first and "9 tok" in first
    assert 'data-component="task"' in first
    # The slider runs over the steps that have samples.
    slider = re.search(r'<input type="range" id="rollout-step"[^>]*>', html).group(0)
    assert 'max="1"' in slider and 'value="1"' in slider and 'data-steps="1,3"' in slider
    assert 'hx-target="#rollouts"' in html and f'hx-get="{url(rollouts)}"' in html


def test_truncated_and_failed_rollouts_are_marked(viewer_client: Client, rollouts: Run) -> None:
    html = viewer_client.get(url(rollouts)).content.decode()
    truncated = re.search(r'<article class="rollout truncated"[^>]*data-finish-reason="length"', html)
    assert truncated
    assert '<span class="badge warning" data-flag="truncated">truncated</span>' in html
    failed = re.search(r'<article class="rollout failed" id="sample-(\d+)"', html)
    assert failed and '<span class="badge danger" data-flag="failed">failed</span>' in html
    assert "reward timed out" in html
    assert html.count('data-flag="failed"') == 1 and html.count('data-flag="truncated"') == 1


def test_choose_a_step(viewer_client: Client, rollouts: Run) -> None:
    html = viewer_client.get(url(rollouts) + "?step=1").content.decode()
    assert groups_of(html) == ["What is 2+2?", "What is 3+3?"]
    assert completions_of(html) == ["4", "5", "6"]
    assert 'id="rollout-latest"' in html  # a way back to the latest step
    by_slider = viewer_client.get(url(rollouts) + "?at=0").content.decode()
    assert completions_of(by_slider) == ["4", "5", "6"]
    nearest = viewer_client.get(url(rollouts) + "?step=2").content.decode()  # no samples at 2: nearest
    assert "Step 1:" in nearest
    assert viewer_client.get(url(rollouts) + "?step=abc").status_code == 404


def test_search_and_sort(viewer_client: Client, rollouts: Run) -> None:
    html = viewer_client.get(url(rollouts) + "?q=9%2B1").content.decode()
    assert groups_of(html) == ["What is 9+1?"]
    html = viewer_client.get(url(rollouts) + "?q=FOUR").content.decode()
    assert completions_of(html) == ["four"]
    by_reward = viewer_client.get(url(rollouts) + "?sort=-reward").content.decode()
    assert groups_of(by_reward) == ["What is 2+2?", "What is 9+1?"]  # mean 0.5 before 0.2
    first = by_reward.split('class="rollout-group')[1]
    rewards = re.findall(r'data-reward="([^"]*)"', first)
    assert rewards == ["1.0", "0.5", "0.0", ""]  # failed (no reward) last
    by_length = viewer_client.get(url(rollouts) + "?sort=length").content.decode()
    assert groups_of(by_length) == ["What is 9+1?", "What is 2+2?"]
    lengths = re.findall(r'data-length="(\d+)"', by_length.split('class="rollout-group')[2])
    assert lengths == sorted(lengths, key=int)


def test_paged_by_prompt_groups(viewer_client: Client, run: Run) -> None:
    add_samples(run, 5, [(f"prompt {i:02d}", [{"completion": f"c{i}"}]) for i in range(19)])
    first = viewer_client.get(url(run)).content.decode()
    assert len(groups_of(first)) == 8 and "page 1 of 3" in first
    third = viewer_client.get(url(run) + "?step=latest&page=3").content.decode()
    assert groups_of(third) == ["prompt 16", "prompt 17", "prompt 18"]
    assert 'data-page="1"' in third and 'aria-current="page">3<' in third


def test_follow_a_prompt_across_steps(viewer_client: Client, rollouts: Run) -> None:
    html = viewer_client.get(url(rollouts)).content.decode()
    follow = re.search(r'hx-get="([^"]*follow=\d+[^"]*)"', html).group(1)
    followed = viewer_client.get(follow.replace("&amp;", "&")).content.decode()
    assert 'class="rollout-browser following"' in followed
    assert re.findall(r'<section class="follow-step" data-step="(\d+)"', followed) == ["1", "3"]
    assert completions_of(followed)[:2] == ["4", "5"]
    assert "9+1" not in followed and "3+3" not in followed
    assert 'id="rollout-back"' in followed
    other = Sample.objects.exclude(run=rollouts).first()
    assert other is None
    assert viewer_client.get(url(rollouts) + "?follow=999999").status_code == 404


def test_long_completions_collapse_with_details(viewer_client: Client, run: Run) -> None:
    text = "\n".join(f"line {i}" for i in range(40))
    add_samples(run, 1, [("p", [{"completion": text}])])
    html = viewer_client.get(url(run)).content.decode()
    shown = completions_of(html)
    assert shown[0] == "\n".join(f"line {i}" for i in range(12)) + "\n"
    assert "".join(shown) == text
    assert '<details class="completion-more">' in html and "28 more lines" in html


def test_completions_are_escaped(viewer_client: Client, run: Run) -> None:
    add_samples(
        run,
        1,
        [
            (
                "<img src=x onerror=alert(1)>",
                [{"completion": "<script>alert('x')</script>", "extra": {"components": {"<b>c</b>": 1}}}],
            )
        ],
    )
    html = viewer_client.get(url(run)).content.decode()
    assert "<script>alert" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<b>c</b>" not in html


def test_share_link_reads_the_same_partial_and_revoked_404(rollouts: Run, member: Any) -> None:
    link = ShareLink.create(rollouts, member)
    anonymous = Client()
    response = anonymous.get(f"/share/{link.token}/rollouts/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-shared="true"' in html and groups_of(html) == ["What is 2+2?", "What is 9+1?"]
    assert f'hx-get="/share/{link.token}/rollouts/' in html and f"/runs/{rollouts.pk}/rollouts/" not in html
    assert '<form method="post"' not in html and "csrf" not in html.lower()
    follow = re.search(r'hx-get="([^"]*follow=\d+[^"]*)"', html).group(1).replace("&amp;", "&")
    assert anonymous.get(follow).status_code == 200
    assert anonymous.post(f"/share/{link.token}/rollouts/").status_code == 405
    link.revoked_at = timezone.now()
    link.save()
    assert anonymous.get(f"/share/{link.token}/rollouts/").status_code == 404
    assert anonymous.get("/share/not-a-token/rollouts/").status_code == 404


def test_a_share_link_opens_only_its_own_run(rollouts: Run, member: Any, project: Project) -> None:
    other = Run.objects.create(project=project, name="other", config=rollouts.config)
    add_samples(other, 1, [("secret prompt", [{"completion": "secret"}])])
    link = ShareLink.create(rollouts, member)
    sample = Sample.objects.get(run=other)
    response = Client().get(f"/share/{link.token}/rollouts/?follow={sample.pk}")
    assert response.status_code == 404
