"""Samples (rollouts) through the API: paging, step filter, text search, sort, steps list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from webapp.runs.models import Run, Sample


@pytest.fixture
def sampled(api_run: Run) -> list[Sample]:
    """Steps 1..5 with 4 rollouts each; rewards and lengths vary, one reward is missing."""
    rows = []
    for step in range(1, 6):
        seq = step  # one samples event per step
        for index in range(4):
            rows.append(
                Sample(
                    run=api_run,
                    step=step,
                    seq=seq,
                    index=index,
                    prompt=f"Step {step}: what is {step} + {index}?",
                    completion=f"The answer is {step + index}." + (" Let me think." if index == 2 else ""),
                    reward=None if (step, index) == (3, 3) else round((step * 7 + index * 3) % 10 / 10, 2),
                    advantage=0.1 * index,
                    length=10 + (step * 5 + index * 11) % 23,
                    finish_reason="stop" if index else "length",
                    extra={"group": index},
                )
            )
    return Sample.objects.bulk_create(rows)


@pytest.fixture
def viewer_client(viewer: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(viewer)


def page(client: Client, run: Run, query: str = "") -> dict[str, Any]:
    response = client.get(f"/api/runs/{run.pk}/samples{query}")
    assert response.status_code == 200, response.content
    return response.json()


def test_pages_cover_every_sample_once(sampled: list[Sample], api_run: Run, viewer_client: Client) -> None:
    seen = []
    offset = 0
    while True:
        body = page(viewer_client, api_run, f"?limit=6&offset={offset}")
        assert body["total"] == 20 and body["step"] is None
        if not body["items"]:
            break
        seen.extend((s["step"], s["index"]) for s in body["items"])
        offset += 6
    assert seen == sorted(seen) and len(seen) == 20 == len(set(seen))
    first = page(viewer_client, api_run, "?limit=1")["items"][0]
    assert first["prompt"] == "Step 1: what is 1 + 0?" and first["finish_reason"] == "length"
    assert first["extra"] == {"group": 0} and first["seq"] == 1


def test_step_filter_and_latest(sampled: list[Sample], api_run: Run, viewer_client: Client) -> None:
    body = page(viewer_client, api_run, "?step=2")
    assert body["step"] == 2 and body["total"] == 4
    assert {s["step"] for s in body["items"]} == {2}
    latest = page(viewer_client, api_run, "?step=latest")
    assert latest["step"] == 5 and [s["index"] for s in latest["items"]] == [0, 1, 2, 3]
    assert page(viewer_client, api_run, "?step=99")["total"] == 0


def test_latest_of_a_run_without_samples(api_run: Run, viewer_client: Client) -> None:
    assert page(viewer_client, api_run, "?step=latest") == {
        "total": 0,
        "limit": 50,
        "offset": 0,
        "step": None,
        "items": [],
    }


def test_search_prompt_and_completion(sampled: list[Sample], api_run: Run, viewer_client: Client) -> None:
    body = page(viewer_client, api_run, "?q=LET+ME+THINK")
    assert body["total"] == 5 and {s["index"] for s in body["items"]} == {2}
    body = page(viewer_client, api_run, "?q=what+is+3+%2B&step=3")
    assert body["total"] == 4
    assert page(viewer_client, api_run, "?q=50%25_off")["total"] == 0  # LIKE wildcards are literal


def test_sort_by_reward_and_length(sampled: list[Sample], api_run: Run, viewer_client: Client) -> None:
    def rewards(query: str) -> list[Any]:
        return [s["reward"] for s in page(viewer_client, api_run, query + "&limit=100")["items"]]

    def lengths(query: str) -> list[int]:
        return [s["length"] for s in page(viewer_client, api_run, query + "&limit=100")["items"]]

    up = rewards("?sort=reward")
    assert up[:-1] == sorted(up[:-1]) and up[-1] is None  # a missing reward sorts last either way
    down = rewards("?sort=-reward")
    assert down[:-1] == sorted(down[:-1], reverse=True) and down[-1] is None
    assert lengths("?sort=length") == sorted(s.length for s in sampled)
    assert lengths("?sort=-length") == sorted((s.length for s in sampled), reverse=True)
    by_step = page(viewer_client, api_run, "?sort=-step&limit=5")["items"]
    assert [s["step"] for s in by_step] == [5, 5, 5, 5, 4]
    # Sorting applies within a filter and pages consistently.
    top = page(viewer_client, api_run, "?step=4&sort=-reward&limit=2")["items"]
    assert [s["reward"] for s in top] == sorted((s.reward for s in sampled if s.step == 4), reverse=True)[:2]


def test_steps_for_a_slider(sampled: list[Sample], api_run: Run, viewer_client: Client) -> None:
    Sample.objects.filter(run=api_run, step=4, index__gte=2).delete()
    body = viewer_client.get(f"/api/runs/{api_run.pk}/samples/steps").json()
    assert body == [
        {"step": 1, "count": 4},
        {"step": 2, "count": 4},
        {"step": 3, "count": 4},
        {"step": 4, "count": 2},
        {"step": 5, "count": 4},
    ]


@pytest.mark.parametrize(
    "query", ["?step=first", "?step=-1", "?sort=prompt", "?limit=0", "?limit=501", "?offset=-3"]
)
def test_bad_sample_queries_are_422(query: str, api_run: Run, viewer_client: Client) -> None:
    response = viewer_client.get(f"/api/runs/{api_run.pk}/samples{query}")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail[0]["loc"][0] == "query" and detail[0]["msg"]
