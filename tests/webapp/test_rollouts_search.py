"""Rollout search over every step (issue 18: a completion seen at step 20 was not found from the
latest step): hits newest step first with their step, the chosen-step scope, paging, the cap."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.db.models import Q
from django.test import Client
from django.test.utils import CaptureQueriesContext

from tests.webapp.test_pages_rollouts import add_samples, completions_of, groups_of, url
from webapp.pages.rollouts import views
from webapp.runs.models import Run, Sample, ShareLink


@pytest.fixture
def thirty_steps(run: Run) -> Run:
    for step in range(1, 31):
        completion = "the zebra answer" if step == 20 else f"plain answer {step}"
        add_samples(run, step, [(f"prompt {step % 3}", [{"completion": completion, "reward": step / 30}])])
    return run


@pytest.fixture
def viewer_client(viewer: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(viewer)


def step_links(html: str) -> list[int]:
    return [int(s) for s in re.findall(r'data-step-link="(\d+)"', html)]


def test_a_search_finds_a_completion_of_an_earlier_step_from_the_latest(viewer_client: Client, thirty_steps: Run) -> None:
    html = viewer_client.get(url(thirty_steps) + "?q=ZEBRA").content.decode()
    assert completions_of(html) == ["the zebra answer"] and step_links(html) == [20]
    assert "1 completion matching “ZEBRA” in 1 prompt group over 1 step" in html
    # The hit's step opens that step with the search kept, limited to it.
    link = re.search(r'href="([^"]*)"[^>]*data-step-link="20"', html).group(1).replace("&amp;", "&")
    assert "step=20" in link and "scope=step" in link and "q=ZEBRA" in link
    at_20 = viewer_client.get(link).content.decode()
    assert completions_of(at_20) == ["the zebra answer"] and 'name="scope" value="step"' in at_20
    assert 'id="rollout-every-step"' in at_20


def test_the_latest_step_alone_does_not_hold_it(viewer_client: Client, thirty_steps: Run) -> None:
    html = viewer_client.get(url(thirty_steps) + "?q=zebra&scope=step").content.decode()
    assert "Step 30:" in html and completions_of(html) == []
    assert 'id="rollout-every-step"' in html  # the way to every step


def test_hits_come_newest_step_first_in_pages(viewer_client: Client, thirty_steps: Run) -> None:
    first = viewer_client.get(url(thirty_steps) + "?q=plain").content.decode()
    assert step_links(first) == [30, 29, 28, 27, 26, 25, 24, 23]  # 8 groups a page
    assert "29 completions matching “plain” in 29 prompt groups over 29 steps" in first
    last = viewer_client.get(url(thirty_steps) + "?q=plain&page=4").content.decode()
    assert step_links(last) == [5, 4, 3, 2, 1]  # step 20 holds the zebra, not "plain"
    by_reward = viewer_client.get(url(thirty_steps) + "?q=plain&sort=reward").content.decode()
    assert step_links(by_reward)[:3] == [1, 2, 3]  # lowest reward first, across steps


def test_a_frequent_word_reads_a_bounded_number_of_hits(
    viewer_client: Client, thirty_steps: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(views, "SEARCH_HITS", 10)
    with CaptureQueriesContext(connection) as queries:
        html = viewer_client.get(url(thirty_steps) + "?q=answer").content.decode()
    assert "The newest 10 completions" in html and "more match" in html
    assert step_links(html) == [30, 29, 28, 27, 26, 25, 24, 23]
    assert len(queries) < 15, [q["sql"] for q in queries]


def test_no_hit_anywhere_says_so(viewer_client: Client, thirty_steps: Run) -> None:
    html = viewer_client.get(url(thirty_steps) + "?q=giraffe").content.decode()
    assert 'id="rollout-no-match"' in html and groups_of(html) == []


def test_a_share_link_searches_every_step_too(thirty_steps: Run, member: Any) -> None:
    link = ShareLink.create(thirty_steps, member)
    html = Client().get(f"/share/{link.token}/rollouts/?q=zebra").content.decode()
    assert completions_of(html) == ["the zebra answer"] and step_links(html) == [20]


def test_like_wildcards_in_a_search_match_themselves(viewer_client: Client, run: Run) -> None:
    add_samples(run, 1, [("p", [{"completion": "a_b 100%"}, {"completion": "axb 1000"}, {"completion": "A\\B"}])])
    assert completions_of(viewer_client.get(url(run) + "?q=a_b").content.decode()) == ["a_b 100%"]
    assert completions_of(viewer_client.get(url(run) + "?q=100%25").content.decode()) == ["a_b 100%"]
    assert completions_of(viewer_client.get(url(run) + "?q=a%5Cb").content.decode()) == ["A\\B"]


def plan_of(queryset: Any) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # the table is tiny: show what the planner can use
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


@pytest.mark.postgresql
def test_on_postgresql_the_search_is_an_ilike_the_trigram_indexes_serve(thirty_steps: Run) -> None:
    """Django's icontains is UPPER(col) LIKE UPPER(...), which no index on the column serves."""
    from webapp.runs import selectors

    sql, _ = selectors.samples(thirty_steps, q="zebra").query.sql_with_params()
    assert "ILIKE" in sql and "UPPER" not in sql
    text = Sample.objects.filter(Q(prompt__search="zebra") | Q(completion__search="zebra"))
    plan = plan_of(text)
    assert "sample_completion_trgm" in plan and "sample_prompt_trgm" in plan, plan
    before = plan_of(Sample.objects.filter(Q(prompt__icontains="zebra") | Q(completion__icontains="zebra")))
    assert "trgm" not in before, before


def test_the_run_page_url_names_the_view_and_only_the_views_parameters() -> None:
    assert views.rollouts_query("step=20&q=zebra+x&evil=%3Cscript%3E&open=5") == "step=20&q=zebra+x&open=5"
    assert views.rollouts_query("q=" + "z" * 500).count("z") == 200
    assert views.rollouts_query("") == ""


def test_the_opened_completion_opens_again(viewer_client: Client, run: Run) -> None:
    (long,) = add_samples(run, 1, [("p", [{"completion": "line\n" * 40}])])
    html = viewer_client.get(url(run) + f"?open={long.pk}").content.decode()
    assert '<details class="completion-more" open>' in html
    assert '<details class="completion-more" open>' not in viewer_client.get(url(run)).content.decode()
