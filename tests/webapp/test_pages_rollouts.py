"""The rollout browser partial: steps, groups side by side, search, sort, follow, share links."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import numpy
import pytest
from django.test import Client
from django.utils import timezone

from webapp.pages.rollouts import views
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


# --- issue 18: the step's distribution, the token view, two runs side by side ---------------------


def distribution_of(html: str) -> dict[str, Any]:
    found = re.search(r'<script id="step-distribution" type="application/json">(.*?)</script>', html, re.S)
    assert found, "no step distribution in the step view"
    return json.loads(found.group(1))


def test_step_view_has_the_reward_histogram_and_scatter(viewer_client: Client, rollouts: Run) -> None:
    dist = distribution_of(viewer_client.get(url(rollouts)).content.decode())
    # Step 3: rewards 0.5, 1.0, 0.0, 0.2 and one unscored; few distinct values: one bar each.
    assert dist["step"] == 3 and dist["samples"] == 5 and dist["unscored"] == 1
    assert dist["histogram"]["x"] == [0.0, 0.2, 0.5, 1.0] and dist["histogram"]["count"] == [1, 1, 1, 1]
    assert dist["histogram"]["width"] == pytest.approx(0.2)
    # (length, reward) points sorted by length: 2 -> 1.0, 3 -> 0.2, 9 -> 0.5, 24 -> 0.0
    assert dist["scatter"] == {"length": [2, 3, 9, 24], "reward": [1.0, 0.2, 0.5, 0.0]}
    # The histogram is of the whole step, whatever a search shows; and it follows the step chosen.
    html = viewer_client.get(url(rollouts), {"q": "four", "scope": "step"}).content.decode()
    assert distribution_of(html)["samples"] == 5
    assert distribution_of(viewer_client.get(url(rollouts), {"step": 1}).content.decode())["step"] == 1


def test_many_distinct_rewards_are_binned_by_sturges_rule(viewer_client: Client, run: Run) -> None:
    rewards = [i / 99 for i in range(100)]  # 100 distinct values in [0, 1]
    add_samples(run, 1, [("p", [{"reward": r, "length": i} for i, r in enumerate(rewards)])])
    dist = distribution_of(viewer_client.get(url(run)).content.decode())
    bins = dist["histogram"]
    assert len(bins["x"]) == 8  # ceil(log2 100) + 1
    counts, edges = numpy.histogram(rewards, bins=8)  # the same rule: equal widths, the last bin closed
    assert bins["count"] == counts.tolist() and sum(bins["count"]) == 100
    assert bins["x"] == pytest.approx(((edges[:-1] + edges[1:]) / 2).tolist())
    assert bins["width"] == pytest.approx(1 / 8)


def test_the_distribution_costs_one_query_not_one_per_sample(
    viewer_client: Client, run: Run, django_assert_num_queries: Any
) -> None:
    add_samples(run, 1, [(f"p{g}", [{"reward": g / 10 + i / 100} for i in range(8)]) for g in range(4)])
    viewer_client.get(url(run))  # the session and user are cached after the first request

    def queries() -> int:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as ctx:
            assert viewer_client.get(url(run)).status_code == 200
        return len(ctx.captured_queries)

    before = queries()
    add_samples(run, 1, [(f"q{g}", [{"reward": 0.5} for _ in range(16)]) for g in range(8)])
    assert queries() == before  # 4x the samples, the same queries
    assert distribution_of(viewer_client.get(url(run)).content.decode())["samples"] == 32 + 128


TOKENS = {
    "text": ["The", " answer", " is", " 4", "<|endoftext|>"],
    "logprob": [-0.01, -2.5, -0.4, -0.105, -3.2],
    "entropy": [0.05, 2.2, 0.9, 0.3, 3.5],
    "count": 9,
}


def test_only_the_page_of_groups_shown_gets_token_views(
    viewer_client: Client, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token view costs a row per token (up to 4,096, and a client's samples need not keep the
    engine's caps): a step's groups off the page are not built at all."""
    from webapp.pages.rollouts import analysis, views

    prompts = [(f"prompt {i}", [{"completion": "c", "extra": {"tokens": TOKENS}}]) for i in range(20)]
    add_samples(run, 1, prompts)
    built: list[int] = []
    real = analysis.token_view
    monkeypatch.setattr(analysis, "token_view", lambda extra: built.append(1) or real(extra))
    html = viewer_client.get(url(run)).content.decode()
    assert len(built) == views.GROUPS_PER_PAGE == html.count('class="token-view"')


def test_a_completion_with_tokens_has_a_coloured_token_view(viewer_client: Client, run: Run) -> None:
    add_samples(
        run,
        1,
        [
            (
                "What is 2+2?",
                [{"completion": "The answer is 4", "extra": {"tokens": TOKENS}}, {"completion": "5"}],
            )
        ],
    )
    html = viewer_client.get(url(run)).content.decode()
    assert html.count('class="token-view"') == 1  # only the completion that has tokens
    view = html.split('class="token-view"')[1].split("</details>")[0]
    toks = re.findall(
        r'<span class="tok"[^>]*data-lp-level="(\d)" data-h-level="(\d)"[^>]*>([^<]*)</span>', view
    )
    # p = exp(logprob): 0.990 (4), 0.082 (1), 0.670 (3), 0.900 (4: >= 0.9), 0.041 (0); entropy levels
    # by 0.1 / 0.5 / 1.5 / 3.0 nats.
    assert toks == [
        ("4", "0", "The"),
        ("1", "3", " answer"),
        ("3", "2", " is"),
        ("4", "1", " 4"),
        ("0", "4", "&lt;|endoftext|&gt;"),
    ]
    assert 'title="logprob -2.500 (p 0.082) · entropy 2.200"' in view
    assert "the first 5 of 9" in view and 'data-mode="logprob"' in view
    assert 'class="tokens" tabindex="0"' in view and 'aria-live="polite"' in view
    assert "p &lt; 0.05" in view and "H ≥ 3.0 nats" in view  # the legends
    # tokens=entropy opens the view coloured by entropy (it is part of the view's URL).
    html = viewer_client.get(url(run), {"tokens": "entropy"}).content.decode()
    assert 'data-mode="entropy"' in html


def test_search_hits_and_a_followed_prompt_show_their_token_views(viewer_client: Client, run: Run) -> None:
    """A completion found by a search over every step, or followed across steps, opens its token
    view there too (not only on its step's page)."""
    for step in (1, 2):
        add_samples(
            run,
            step,
            [("What is 2+2?", [{"completion": f"The answer is 4 ({step})", "extra": {"tokens": TOKENS}}])],
        )
    found = viewer_client.get(url(run), {"q": "answer is 4"}).content.decode()
    assert "2 completions matching “answer is 4” in 2 prompt groups over 2 steps" in found
    assert re.findall(r'data-step-link="(\d+)"', found) == ["2", "1"]  # newest step first
    assert found.count('class="token-view"') == 2  # one per step's hit
    follow = re.search(r'hx-get="([^"]*follow=\d+[^"]*)"', found).group(1)
    followed = viewer_client.get(follow.replace("&amp;", "&")).content.decode()
    assert re.findall(r'<section class="follow-step" data-step="(\d+)"', followed) == ["1", "2"]
    assert followed.count('class="token-view"') == 2


def test_tokens_without_entropy_say_so_and_malformed_tokens_are_not_shown(
    viewer_client: Client, run: Run
) -> None:
    no_entropy = {"text": ["a", "b"], "logprob": [-0.1, -0.2], "count": 2}
    bad = [
        {"text": ["a", "b"], "logprob": [-0.1]},  # lengths differ
        {"text": ["a"], "logprob": ["x"]},  # not a number
        {"text": ["a"], "logprob": [0.5]},  # a log-probability above 0
        "tokens",
    ]
    add_samples(
        run,
        1,
        [("p", [{"extra": {"tokens": no_entropy}}] + [{"extra": {"tokens": b}} for b in bad])],
    )
    html = viewer_client.get(url(run), {"tokens": "entropy"}).content.decode()
    assert html.count('class="token-view"') == 1
    assert 'data-mode="logprob"' in html and "data-no-entropy" in html
    assert re.search(r'value="entropy" disabled', html)


def test_compare_a_prompt_with_another_run_side_by_side(
    viewer_client: Client, rollouts: Run, make_run: Callable[..., Run], other_team: Any
) -> None:
    other = make_run(name="dapo-run")
    add_samples(other, 2, [("What is 2+2?", [{"completion": "four!", "reward": 1.0}])])
    add_samples(
        other,
        5,
        [("What is 2+2?", [{"completion": "IV", "reward": 0.0}, {"completion": "4", "reward": 1.0}])],
    )
    add_samples(other, 5, [("What is 9+1?", [{"completion": "ten"}])])
    unrelated = make_run(name="no-shared-prompt")
    add_samples(unrelated, 1, [("Something else", [{"completion": "x"}])])
    html = viewer_client.get(url(rollouts)).content.decode()
    anchor = re.search(r'data-compare="(\d+)"', html).group(1)
    # The card's link lists the runs of the project with this prompt: not the run itself, not the unrelated one.
    html = viewer_client.get(url(rollouts), {"compare": anchor}).content.decode()
    choices = html.split('id="compare-with"')[1].split("</select>")[0]
    assert re.findall(r'<option value="(\d+)"', choices) == [str(other.pk)]
    assert "latest step 5" in html and 'id="side-by-side"' not in html
    # Picking it: both runs' completions of that prompt, each at its latest step.
    html = viewer_client.get(url(rollouts), {"compare": anchor, "with": other.pk}).content.decode()
    sides = html.split('class="compare-side"')[1:]
    assert [re.search(r'data-step="(\d+)"', s).group(1) for s in sides] == ["3", "5"]
    assert completions_of(sides[0])[:2] == ["four", "4"] and "boom" in completions_of(sides[0])
    assert completions_of(sides[1]) == ["IV", "4"]
    assert "ten" not in sides[1]  # another prompt
    # One colour scale for both: this run's rewards span 0..1 and so do the other's.
    assert re.findall(r'data-reward-level="(\d?)"', sides[1]) == ["0", "4"]
    # A step of each side is selectable and stays in the query.
    html = viewer_client.get(
        url(rollouts), {"compare": anchor, "with": other.pk, "a_step": 1, "b_step": 2}
    ).content.decode()
    sides = html.split('class="compare-side"')[1:]
    assert [re.search(r'data-step="(\d+)"', s).group(1) for s in sides] == ["1", "2"]
    assert completions_of(sides[1]) == ["four!"]
    assert "compare" in views.VIEW_PARAMS and "with" in views.VIEW_PARAMS


def test_compare_rejects_bad_input(
    viewer_client: Client, rollouts: Run, make_run: Callable[..., Run], other_team: Any, member: Any
) -> None:
    anchor = Sample.objects.filter(run=rollouts).first()
    assert viewer_client.get(url(rollouts), {"compare": "x"}).status_code == 404
    assert viewer_client.get(url(rollouts), {"compare": 999999}).status_code == 404
    assert viewer_client.get(url(rollouts), {"compare": anchor.pk, "with": "1;drop"}).status_code == 404
    assert viewer_client.get(url(rollouts), {"compare": anchor.pk, "with": 999999}).status_code == 404
    assert viewer_client.get(url(rollouts), {"compare": anchor.pk, "a_step": "-1"}).status_code == 404
    # Another team's run, or another project's, is not compared with (a member of it or not).
    foreign_project = Project.objects.create(team=other_team, name="Other", slug="other")
    foreign = Run.objects.create(project=foreign_project, name="theirs", config=rollouts.config)
    add_samples(foreign, 1, [("What is 2+2?", [{"completion": "leak"}])])
    response = viewer_client.get(url(rollouts), {"compare": anchor.pk, "with": foreign.pk})
    assert response.status_code == 404 and b"leak" not in response.content
    sibling_project = Project.objects.create(team=rollouts.project.team, name="Sibling", slug="sibling")
    sibling = Run.objects.create(project=sibling_project, name="sibling", config=rollouts.config)
    assert viewer_client.get(url(rollouts), {"compare": anchor.pk, "with": sibling.pk}).status_code == 404
    # A sample of another run is not an anchor here; a share link has no comparison.
    other = make_run(name="other")
    (theirs,) = add_samples(other, 1, [("What is 2+2?", [{"completion": "x"}])])
    assert viewer_client.get(url(rollouts), {"compare": theirs.pk}).status_code == 404
    link = ShareLink.create(rollouts, member)
    assert Client().get(f"/share/{link.token}/rollouts/", {"compare": anchor.pk}).status_code == 404
    assert "data-compare" not in Client().get(f"/share/{link.token}/rollouts/").content.decode()


def test_samples_know_their_prompt_hash_and_lookups_use_the_index(rollouts: Run) -> None:
    from django.db import connection

    sample = Sample.objects.filter(run=rollouts, prompt="What is 2+2?").first()
    assert sample.prompt_hash == hashlib.md5(b"What is 2+2?").hexdigest()
    # By prompt across runs, as side_by_side.candidates looks up: only this index serves it. (Within
    # one run, PostgreSQL may equally pick the run_id index on a table this small: the plans tie.)
    qs = Sample.objects.filter(prompt_hash=sample.prompt_hash).values_list("run", "step")
    plan = qs.explain()
    index = "sample_prompt_run_step"
    if connection.vendor == "postgresql":
        # A tiny table may be scanned whole; with scans off the planner must have the index to use.
        with connection.cursor() as cursor:
            cursor.execute("SET enable_seqscan = off")
            try:
                plan = qs.explain()
            finally:
                cursor.execute("SET enable_seqscan = on")
    assert index in plan


def test_the_token_view_settings_are_on_the_launch_form(
    member: Any, client_for: Callable[..., Client], project: Project
) -> None:
    """The launch form renders the engine's schema: the logging fields that bound the token view are
    there with their bounds, nothing to add by hand."""
    page = client_for(member).get(f"/projects/{project.pk}/new/").content.decode()
    for name, low, high in (
        ("token_samples_per_step", 0, 64),
        ("tokens_per_sample", 1, 4096),
        ("token_entropy_top_k", 0, 20),
    ):
        field = re.search(rf'<input[^>]*name="logging\.{name}"[^>]*>', page)
        assert field, f"logging.{name} is not on the launch form"
        assert f'min="{low}"' in field.group(0) and f'max="{high}"' in field.group(0)
