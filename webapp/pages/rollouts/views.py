"""The rollout browser: an HTML partial the run page loads into ``<section id="rollouts">``.

One step at a time (a slider over the steps that have samples, or the latest), each prompt's
group of completions side by side; sort by reward or length, pages of groups. A search looks at
every step (each hit with its step), or at the chosen step only (``scope=step``). "Follow"
shows one prompt's completions across steps instead. The step view draws the step's reward
histogram and length-against-reward scatter (``analysis.step_distribution``); a completion the engine
sent with its tokens opens a token view coloured by log-probability or entropy (``tokens=entropy``
picks the latter); "Compare with another run" sets two runs' completions of one prompt side by side
(``side_by_side.py``). The same partial serves a share link, read-only (it has no actions that change
anything anyway, and no comparison with the project's other runs).
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from webapp.inputs import INT_MAX, parse_id
from webapp.pages.rollouts import analysis, side_by_side
from webapp.runs import selectors
from webapp.runs.models import Run, Sample, prompt_hash
from webapp.runs.sharing import shared_run_or_404
from webapp.teams import access

GROUPS_PER_PAGE = 8
STEPS_PER_PAGE = 10
MAX_SAMPLES = 5000  # per request: a step holds at most logging.samples_per_step (<= 4096)
# A search over every step reads at most this many hits, newest first. A frequent word makes
# PostgreSQL walk the (run, step) index backwards testing each completion until it has them:
# 1,000 hits of a word in 5% of 256,000 completions read 19,700 rows, 0.17 s on a loaded 2-core
# machine; 5,000 read 98,600 rows, 0.98 s (bench/rollout_search.py, EXPLAIN ANALYZE).
SEARCH_HITS = 1000
PREVIEW_LINES = 12
PREVIEW_CHARS = 1200
SCOPES = ("all", "step")  # where a search looks: every step (the default), or the chosen step only
REWARD_LEVELS = 5  # app.css's card colours, data-reward-level 0 (the run's lowest) .. 4 (highest)
SORTS = {
    "": "as generated",
    "-reward": "reward, high first",
    "reward": "reward, low first",
    "-length": "length, long first",
    "length": "length, short first",
}


VIEW_PARAMS = (
    *("step", "at", "q", "sort", "page", "follow", "scope", "open", "tokens"),
    *("compare", "with", "a_step", "b_step"),  # side by side with another run (side_by_side.py)
)


def rollouts_query(raw: str) -> str:
    """The rollout view a run page URL names (``?rollouts=<query>``, written by rollouts.js), as
    the query string of the partial the page loads: only the view's own parameters, each cut to
    200 characters. Anything else in it is dropped, so the page URL can carry nothing the
    partial does not read itself."""
    params = QueryDict(raw[:2000])
    return urlencode({k: params[k][:200] for k in VIEW_PARAMS if params.get(k)})


def _split(text: str, lines: int = PREVIEW_LINES, chars: int = PREVIEW_CHARS) -> tuple[str, str]:
    """``text`` as a preview of at most ``lines`` lines / ``chars`` characters, and the rest."""
    cut = len(text)
    pos = -1
    for _ in range(lines):
        pos = text.find("\n", pos + 1)
        if pos < 0:
            break
    else:
        cut = pos + 1
    if cut > chars:
        space = text.rfind(" ", 0, chars)
        cut = space + 1 if space > chars // 2 else chars
    if cut >= len(text):
        return text, ""
    return text[:cut], text[cut:]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _reward_range(run: Run) -> tuple[float, float] | None:
    """The run's lowest and highest reward, which a card's colour is relative to (None: no
    rewards yet).

    Relative to the run rather than a fixed scale: a 0/1 task shows red and green, a graded
    reward of any magnitude the shades between, and a card's colour says where it stands among
    the run's rollouts. Two LIMIT 1 queries on the ``(run, reward)`` index."""
    rewarded = Sample.objects.filter(run=run, reward__isnull=False, superseded=False).order_by("reward")
    lowest = rewarded.values_list("reward", flat=True).first()
    highest = rewarded.values_list("reward", flat=True).last()
    return None if lowest is None or highest is None else (lowest, highest)


def _reward_level(reward: float | None, scale: tuple[float, float] | None) -> int | None:
    """Where ``reward`` falls in the run's range, 0 (lowest) .. REWARD_LEVELS - 1 (highest);
    None without a reward, or when every reward of the run is the same (nothing to compare)."""
    if reward is None or scale is None or scale[1] <= scale[0]:
        return None
    low, high = scale
    fraction = (reward - low) / (high - low)
    return min(max(round(fraction * (REWARD_LEVELS - 1)), 0), REWARD_LEVELS - 1)


def _rollout(sample: Sample, scale: tuple[float, float] | None, tokens: bool = True) -> dict[str, Any]:
    """One completion as its card shows it; ``tokens``: with its token view (a page of groups: the
    view costs a row per token, so a step's other groups go without)."""
    extra = sample.extra if isinstance(sample.extra, dict) else {}
    components = extra.get("components")
    components = (
        [{"name": str(k), "value": _number(v), "raw": v} for k, v in components.items()]
        if isinstance(components, dict)
        else []
    )
    error = extra.get("error")
    failed = sample.reward is None or bool(error)
    truncated = sample.finish_reason == "length"
    preview, rest = _split(sample.completion)
    return {
        "id": sample.pk,
        "step": sample.step,
        "index": sample.index,
        "completion": sample.completion,
        "preview": preview,
        "rest": rest,
        "rest_lines": rest.count("\n") + (1 if rest and not rest.endswith("\n") else 0),
        "reward": sample.reward,
        "reward_level": _reward_level(sample.reward, scale),
        "advantage": sample.advantage,
        "length": sample.length,
        "finish_reason": sample.finish_reason,
        "components": components,
        "error": str(error) if error else "",
        "failed": failed,
        "truncated": truncated,
        "policy_version": extra.get("policy_version"),
        "group": extra.get("group"),
        "tokens": analysis.token_view(extra) if tokens else None,
    }


def _sort_key(sort: str) -> Any:
    field = sort.lstrip("-")
    sign = -1 if sort.startswith("-") else 1

    def key(r: dict[str, Any]) -> tuple:
        value = r[field]
        return (value is None, sign * value if value is not None else 0, r["step"], r["index"])

    return key


def _order(groups: list[dict[str, Any]], sort: str) -> None:
    """Sort groups in place by their mean reward or length (``sort``; "" keeps their order)."""
    if sort:
        field = "mean_reward" if sort.lstrip("-") == "reward" else "mean_length"
        sign = -1 if sort.startswith("-") else 1
        groups.sort(key=lambda g: (g[field] is None, sign * (g[field] or 0)))


def _groups(
    samples: list[Sample], sort: str, scale: tuple[float, float] | None, tokens: bool = True
) -> list[dict[str, Any]]:
    """Rollouts grouped by prompt text, in order of first appearance (or by the sort); each
    rollout's colour is relative to the run's reward range ``scale``; ``tokens``: see ``_rollout``."""
    by_prompt: dict[str, dict[str, Any]] = {}
    for sample in samples:
        group = by_prompt.get(sample.prompt)
        if group is None:
            extra = sample.extra if isinstance(sample.extra, dict) else {}
            preview, rest = _split(sample.prompt, lines=6, chars=600)
            group = by_prompt[sample.prompt] = {
                "prompt": sample.prompt,
                "prompt_preview": preview,
                "prompt_rest": rest,
                "answer": extra.get("answer"),
                "first_id": sample.pk,
                "rollouts": [],
            }
        group["rollouts"].append(_rollout(sample, scale, tokens))
    groups = list(by_prompt.values())
    for group in groups:
        rewards = [r["reward"] for r in group["rollouts"] if r["reward"] is not None]
        group["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
        group["mean_length"] = sum(r["length"] for r in group["rollouts"]) / len(group["rollouts"])
        group["failed"] = sum(r["failed"] for r in group["rollouts"])
        group["truncated"] = sum(r["truncated"] for r in group["rollouts"])
        if sort:
            group["rollouts"].sort(key=_sort_key(sort))
    _order(groups, sort)
    return groups


def _url(base_url: str, **params: Any) -> str:
    query = urlencode({k: v for k, v in params.items() if v not in (None, "")})
    return f"{base_url}?{query}" if query else base_url


def _pages(base_url: str, page: int, pages: int, **params: Any) -> list[dict[str, Any]]:
    return [
        {"n": n, "url": _url(base_url, page=n, **params), "current": n == page} for n in range(1, pages + 1)
    ]


def _int(value: str | None, default: int) -> int:
    """A page number or id from the query string (ASCII digits, within bigint), else ``default``."""
    parsed = parse_id(value)
    return max(parsed, 1) if parsed is not None else default


def _browse(request: HttpRequest, run: Run, base_url: str, shared: bool) -> HttpResponse:
    q = request.GET.get("q", "").strip()[:200]
    sort = request.GET.get("sort", "")
    if sort not in SORTS:
        sort = ""
    page = _int(request.GET.get("page"), 1)
    context: dict[str, Any] = {
        "run": run,
        "base_url": base_url,
        "shared": shared,
        "q": q,
        "sort": sort,
        "sorts": SORTS.items(),
        "follow": None,
        "reward_range": _reward_range(run),
        "open_id": parse_id(request.GET.get("open")),  # the completion the user had opened
        "token_mode": "entropy" if request.GET.get("tokens") == "entropy" else "logprob",
        "token_legend": analysis.token_legend(),
    }
    if request.GET.get("compare"):
        return side_by_side.compare_view(
            request, run, context, url=_url, groups=_groups, reward_range=_reward_range
        )
    base = selectors.samples(run, q=q)

    follow = request.GET.get("follow")
    if follow:
        anchor = Sample.objects.filter(run=run, pk=_int(follow, 0)).first()
        if anchor is None:
            raise Http404("sample not found")
        return _follow(request, run, anchor, base, context, page)

    scope = request.GET.get("scope", "")
    context["scope"] = scope if scope in SCOPES else ""
    if q and context["scope"] != "step":
        return _search(request, run, base, context, page)

    # The steps that have samples (one GROUP BY over the run's samples): the step view's slider alone needs them.
    steps = context["steps"] = [s["step"] for s in selectors.sample_steps(run)]
    raw_step = request.GET.get("step") or ""
    at = request.GET.get("at")
    at_index = parse_id(at)
    if not raw_step and at_index is not None and steps:
        raw_step = str(steps[min(at_index, len(steps) - 1)])  # the slider moves over the steps' indices
    raw_step = raw_step or "latest"
    step: int | None
    latest = raw_step == "latest" or not steps
    if latest:
        step = steps[-1] if steps else None
    else:
        parsed = parse_id(raw_step, INT_MAX)
        if parsed is None:
            raise Http404("step must be a step number or 'latest'")
        wanted = parsed
        if wanted not in steps:  # the nearest step that has samples
            wanted = min(steps, key=lambda s: (abs(s - wanted), s))
        step = wanted
    samples = list(base.filter(step=step).order_by("seq", "index")[:MAX_SAMPLES]) if step is not None else []
    groups = _groups(samples, sort, context["reward_range"], tokens=False)
    pages = max(math.ceil(len(groups) / GROUPS_PER_PAGE), 1)
    page = min(page, pages)
    shown = groups[(page - 1) * GROUPS_PER_PAGE : page * GROUPS_PER_PAGE]
    extras = {sample.pk: sample.extra for sample in samples}
    for group in shown:
        for rollout in group["rollouts"]:  # the token views of the page's groups only
            extra = extras.get(rollout["id"])
            rollout["tokens"] = analysis.token_view(extra) if isinstance(extra, dict) else None
        group["follow_url"] = _url(base_url, follow=group["first_id"], sort=sort, q=q)
        if not shared:
            group["compare_url"] = _url(base_url, compare=group["first_id"])
    step_param = "latest" if latest else step
    scope = context["scope"]
    context.update(
        every_step_url=_url(base_url, q=q, sort=sort) if q else "",
        latest_url=_url(base_url, step="latest", q=q, sort=sort, scope=scope),
        page_links=_pages(base_url, page, pages, step=step_param, q=q, sort=sort, scope=scope),
        step=step,
        latest=latest,
        step_index=steps.index(step) if step is not None else 0,
        groups=shown,
        group_count=len(groups),
        sample_count=len(samples),
        page=page,
        pages=pages,
        distribution=analysis.step_distribution(run, step) if step is not None else None,
    )
    return render(request, "pages/rollouts/browser.html", context)


def _search(request: HttpRequest, run: Run, base: Any, context: dict[str, Any], page: int) -> HttpResponse:
    """Search every step: the matching completions newest step first, grouped by step and prompt.

    A completion seen at step 20 is found from any view (issue 18): the step slider limits a
    search only when asked (``scope=step``). Two queries: the hits' keys (at most
    ``SEARCH_HITS``, newest first; the summary says when there were more), which place every hit
    in its group and sort the groups; then the full rows of the one page of groups shown. The
    text condition is ``__search``, which the trigram indexes serve on PostgreSQL
    (``webapp.runs.lookups``; bench/rollout_search.py)."""
    base_url, q, sort = context["base_url"], context["q"], context["sort"]
    keys = list(
        base.order_by("-step", "seq", "index").values_list("id", "step", "prompt", "reward", "length")[
            : SEARCH_HITS + 1
        ]
    )
    capped = len(keys) > SEARCH_HITS
    keys = keys[:SEARCH_HITS]
    found: dict[tuple[int, str], dict[str, Any]] = {}  # (step, prompt) -> the group's ids and means
    for pk, step, prompt, reward, length in keys:
        group = found.setdefault((step, prompt), {"step": step, "ids": [], "rewards": [], "lengths": []})
        group["ids"].append(pk)
        if reward is not None:
            group["rewards"].append(reward)
        group["lengths"].append(length)
    groups = list(found.values())  # newest step first
    for group in groups:
        group["mean_reward"] = sum(group["rewards"]) / len(group["rewards"]) if group["rewards"] else None
        group["mean_length"] = sum(group["lengths"]) / len(group["lengths"])
    _order(groups, sort)
    pages = max(math.ceil(len(groups) / GROUPS_PER_PAGE), 1)
    page = min(page, pages)
    page_groups = groups[(page - 1) * GROUPS_PER_PAGE : page * GROUPS_PER_PAGE]
    rows = Sample.objects.in_bulk([pk for g in page_groups for pk in g["ids"]])
    shown = []
    for found_group in page_groups:
        (group,) = _groups(
            [rows[pk] for pk in found_group["ids"] if pk in rows], sort, context["reward_range"]
        )
        group["step"] = found_group["step"]
        group["step_url"] = _url(base_url, step=group["step"], q=q, sort=sort, scope="step")
        group["follow_url"] = _url(base_url, follow=group["first_id"], sort=sort, q=q)
        shown.append(group)
    context.update(
        searching=True,
        groups=shown,
        group_count=len(groups),
        sample_count=len(keys),
        step_count=len({g["step"] for g in groups}),
        capped=capped,
        page=page,
        pages=pages,
        page_links=_pages(base_url, page, pages, q=q, sort=sort),
        this_step_url=_url(base_url, step="latest", q=q, sort=sort, scope="step"),
    )
    return render(request, "pages/rollouts/search.html", context)


def _follow(
    request: HttpRequest, run: Run, anchor: Sample, base: Any, context: dict[str, Any], page: int
) -> HttpResponse:
    # By the prompt's hash (the (prompt_hash, run, step) index), then its text (a collision shows nothing wrong).
    same_prompt = base.filter(
        prompt_hash=anchor.prompt_hash or prompt_hash(anchor.prompt), prompt=anchor.prompt
    )
    samples = list(same_prompt.order_by("step", "seq", "index")[:MAX_SAMPLES])
    by_step: dict[int, list[Sample]] = {}
    for sample in samples:
        by_step.setdefault(sample.step, []).append(sample)
    step_list = sorted(by_step)
    pages = max(math.ceil(len(step_list) / STEPS_PER_PAGE), 1)
    page = min(page, pages)
    shown = step_list[(page - 1) * STEPS_PER_PAGE : page * STEPS_PER_PAGE]
    per_step = [
        {"step": s, "group": _groups(by_step[s], context["sort"], context["reward_range"])[0]} for s in shown
    ]
    preview, rest = _split(anchor.prompt, lines=6, chars=600)
    context.update(
        follow={
            "id": anchor.pk,
            "prompt": anchor.prompt,
            "preview": preview,
            "rest": rest,
            "step": anchor.step,
        },
        per_step=per_step,
        step_count=len(step_list),
        sample_count=len(samples),
        page=page,
        pages=pages,
        page_links=_pages(
            context["base_url"], page, pages, follow=anchor.pk, q=context["q"], sort=context["sort"]
        ),
        back_url=_url(context["base_url"], step=anchor.step, q=context["q"], sort=context["sort"]),
    )
    return render(request, "pages/rollouts/follow.html", context)


@login_required
@require_GET
def run_rollouts(request: HttpRequest, run_id: int) -> HttpResponse:
    try:
        run = access.run_for(request.user, run_id)
    except access.NotFound:
        raise Http404("run not found") from None
    return _browse(request, run, reverse("run-rollouts", kwargs={"run_id": run.pk}), shared=False)


@require_GET
def shared_rollouts(request: HttpRequest, token: str) -> HttpResponse:
    run = shared_run_or_404(token)
    return _browse(request, run, reverse("shared-rollouts", kwargs={"token": token}), shared=True)
