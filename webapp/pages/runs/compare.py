"""The compare page: which runs (from the link), the run search that adds more, the config diff,
the summary table, and the JSON the page's scripts start from.

The page (``compare.js``) adds and drops runs without a reload: it asks ``compare/parts/`` for the
server-rendered parts of the new selection (runs table, summary, config diff and their JSON) and
``compare/search.json`` for runs to add. Every query here is one per page, whatever the number of
runs: the runs in one query, the attempts in one, the metric summaries ingest keeps (final, min, max:
``webapp.analysis``) in two, and the names of the metrics in one more (``metric_name_union``).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.db.models import Max, Q
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET

from webapp.analysis import config_keys
from webapp.analysis.config_keys import flatten
from webapp.analysis.models import ConfigValue, MetricSummary
from webapp.inputs import parse_ids, text_problem
from webapp.live.routing import run_socket_path
from webapp.pages.runs.display import api_base
from webapp.runs import housekeeping, selectors
from webapp.runs.choices import FINAL_STATUSES, RunStatus
from webapp.runs.models import Run, RunAttempt

MAX_RUNS = 12  # one distinct colour each (charts.js PALETTE)
SEARCH_LIMIT = 20  # runs one search answers with
MAX_QUERY = 200  # characters of a search
MAX_TERMS = 8  # words of a search
CONFIG_KEYS = 400  # dotted config keys per run sent to the page (grouping, scatter, parallel axes)
VALUE_CHARS = 120  # characters of one config value sent to the page

# Metrics of the summary table: name and which way is better (None: final value only).
KEY_METRICS: list[tuple[str, str | None]] = [
    ("reward/mean", "max"),
    ("train/accuracy", "max"),
    ("eval/accuracy", "max"),
    ("actor/entropy", None),
    ("actor/kl_loss", "min"),
    ("response_length/mean", None),
    ("actor/grad_norm", None),
]


MISSING = object()


def _show(value: Any) -> str:
    if value is MISSING:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def config_diff(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per dotted key of any config: the value of each run (``—`` where absent) and
    whether they differ. Keys in first-seen order."""
    flat = [flatten(c or {}) for c in configs]
    keys: list[str] = []
    seen: set[str] = set()
    for f in flat:
        for key in f:
            if key not in seen:
                seen.add(key)
                keys.append(key)
    rows = []
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        canon = {json.dumps(v, sort_keys=True) if v is not MISSING else "\0missing" for v in values}
        rows.append({"key": key, "values": [_show(v) for v in values], "differs": len(canon) > 1})
    return rows


def page_config(config: dict[str, Any]) -> dict[str, str | float | bool | None]:
    """The run's config as the page groups, plots and lays axes by it: dotted keys, numbers and
    booleans kept as they are, everything else as text, bounded (``CONFIG_KEYS`` keys,
    ``VALUE_CHARS`` characters a value) since a config may be an external run's free-form one."""
    out: dict[str, str | float | bool | None] = {}
    for key, value in list(flatten(config or {}).items())[:CONFIG_KEYS]:
        if value is None or isinstance(value, bool | int | float):
            out[key] = value
        else:
            out[key] = _show(value)[:VALUE_CHARS]
    return out


# --- which runs --------------------------------------------------------------------------------


def load_runs(user: Any, wanted: list[int]) -> list[Run]:
    """The runs of ``wanted`` the user may see, in the link's order, in one query."""
    found = {r.pk: r for r in selectors.runs_visible_to(user).filter(pk__in=wanted).select_related("project")}
    return [found[i] for i in wanted if i in found]


def points_attempts(runs: list[Run]) -> dict[int, int]:
    """Per run, the latest attempt whose points its history holds (0: none): a point of a later
    attempt is a rewind (``series.js``, ``Attempts``). One query for all runs."""
    rows = (
        RunAttempt.objects.filter(run__in=runs, first_step__isnull=False)
        .values("run_id")
        .annotate(latest=Max("number"))
        .order_by()
    )
    return {row["run_id"]: row["latest"] for row in rows}


def metric_name_union(runs: list[Run]) -> list[str]:
    """The names any of ``runs`` logged, in the database's name order: one query of the metric
    summaries ingest keeps (one row per run and name, ``webapp.analysis``), served by their
    unique (run, name) index. The points are never read: a probe of the points per name with
    ``run IN (...)`` was a full scan on PostgreSQL (about 0.5 s a name, 15 s a page of 8 runs of
    30 metrics of 10,000 steps)."""
    if not runs:
        return []
    return list(
        MetricSummary.objects.filter(run__in=runs).order_by("name").values_list("name", flat=True).distinct()
    )


def summary(runs: list[Run]) -> list[dict[str, Any]]:
    """Per key metric that any run logged: per run the final value and the best one, from the
    metric summaries ingest keeps (``webapp.analysis``): one query, no point read."""
    if not runs:
        return []
    names = [n for n, _ in KEY_METRICS]
    kept = {
        (row.run_id, row.name): row
        for row in MetricSummary.objects.filter(run__in=runs, name__in=names).only(
            "run", "name", "last", "min", "max"
        )
    }
    rows = []
    for name, better in KEY_METRICS:
        if not any((r.pk, name) in kept for r in runs):
            continue
        cells = []
        for r in runs:
            row = kept.get((r.pk, name))
            best = None
            if row is not None and better is not None:
                best = row.max if better == "max" else row.min
            cells.append({"final": row.last if row else None, "best": best})
        rows.append({"name": name, "better": better, "cells": cells})
    return rows


def page_summaries(runs: list[Run]) -> dict[int, dict[str, list[float]]]:
    """Per run, each metric's [final, min, max] (``MetricSummary``), at most ``CONFIG_KEYS``
    metrics a run: what the scatter and the parallel axes plot, without reading a series."""
    out: dict[int, dict[str, list[float]]] = {r.pk: {} for r in runs}
    rows = (
        MetricSummary.objects.filter(run__in=runs)
        .order_by("run", "name")
        .values_list("run_id", "name", "last", "min", "max")
    )
    for run_id, name, last, low, high in rows:
        if len(out[run_id]) < CONFIG_KEYS:
            out[run_id][name] = [last, low, high]
    return out


def parts_context(user: Any, runs_param: str) -> dict[str, Any]:
    """What the page's server-rendered parts show for ``?runs=`` (ids, commas): the same for the
    whole page and for ``compare/parts/`` (what the page swaps in after an add or a drop)."""
    wanted, bad = parse_ids([runs_param])
    too_many = len(wanted) > MAX_RUNS
    wanted = wanted[:MAX_RUNS]
    runs = load_runs(user, wanted)
    attempts = points_attempts(runs)
    summaries = page_summaries(runs)
    rows = config_diff([r.config for r in runs])
    return {
        "runs": runs,
        "dropped": len(wanted) - len(runs) + len(bad),
        "too_many": too_many,
        "max_runs": MAX_RUNS,
        "diff_rows": rows,
        "diff_count": sum(1 for r in rows if r["differs"]),
        "summary": summary(runs),
        "runs_param": ",".join(str(r.pk) for r in runs),
        "page_data": {
            "runs": [
                {
                    "id": r.pk,
                    "name": r.name,
                    "status": r.status,
                    "is_final": RunStatus(r.status) in FINAL_STATUSES,
                    # Where the page's socket of a live run starts: read here, before the
                    # history the page reads next (compare.js, lastSeq).
                    "last_seq": r.last_seq,
                    "points_attempt": attempts.get(r.pk, 0),
                    "api": api_base(r.pk),
                    "socket": run_socket_path(r.pk),
                    "config": page_config(r.config),
                    "summaries": summaries[r.pk],
                }
                for r in runs
            ],
            "diff_keys": [row["key"] for row in rows if row["differs"]],
            "metric_names": metric_name_union(runs),
            "max_runs": MAX_RUNS,
        },
    }


# --- the search --------------------------------------------------------------------------------


class SearchError(ValueError):
    """A search the page cannot run; the message names the part and the fix."""


_STATUSES = {s.value for s in RunStatus}
SEARCH_HELP = (
    "words match a run's name, tag or status; status:running and tag:baseline match exactly; "
    "a config value is key=value with a dotted key, e.g. optimizer.lr=1e-6 or algorithm.name=grpo"
)


def search_filter(query: str) -> tuple[dict[str, Any], Q, list[str]]:
    """The runs ``query`` asks for, every word matching (``SEARCH_HELP``): the aliases the filter
    reads (none: a config value is found through ``ConfigValue``'s (key, digest) index), the
    filter, and the whole tags asked for by ``tag:`` (matched exactly, by ``selectors.with_tag``).
    Raises SearchError naming the word and the fix."""
    if len(query) > MAX_QUERY:
        raise SearchError(f"q: at most {MAX_QUERY} characters, got {len(query)}: shorten the search")
    problem = text_problem(query)
    if problem:
        raise SearchError(f"q {problem}")
    words = query.split()
    if len(words) > MAX_TERMS:
        raise SearchError(f"q: at most {MAX_TERMS} words, got {len(words)}: drop some")
    aliases: dict[str, Any] = {}
    found = Q()
    tags: list[str] = []
    for word in words:
        if "=" in word:
            key, _, raw = word.partition("=")
            if config_keys.path_problem(key) or not raw:
                raise SearchError(
                    f"q: {word!r} is not a config filter: write key=value with a key path of "
                    f"{config_keys.PATH_HELP} (e.g. optimizer.lr=1e-6)"
                )
            # The text or the JSON value it reads as (1e-6 the number; "grpo" the text).
            values = ConfigValue.objects.filter(key=key, digest__in=config_keys.loose_digests(raw))
            found &= Q(pk__in=values.values("run_id"))
        elif word.lower().startswith("status:"):
            status = word[7:].lower()
            if status not in _STATUSES:
                raise SearchError(f"q: unknown status {status!r}: use one of {', '.join(sorted(_STATUSES))}")
            found &= Q(status=status)
        elif word.lower().startswith("tag:"):
            # The whole tag, exactly (a list element, not a part of the list's JSON text: text
            # matching missed a non-ASCII tag on PostgreSQL, whose jsonb keeps what json.dumps escapes).
            tags.append(word[4:])
        else:
            found &= Q(name__icontains=word) | Q(tags__icontains=word) | Q(status__iexact=word)
    return aliases, found, tags


def search(user: Any, query: str, exclude: list[int], limit: int = SEARCH_LIMIT) -> list[dict[str, Any]]:
    """Runs the user can see (archived ones left out) that match ``query``, newest first, not
    those in ``exclude`` (the runs shown already). One query."""
    aliases, found, tags = search_filter(query)
    qs = housekeeping.listed(selectors.runs_visible_to(user))
    for tag in tags:
        qs = selectors.with_tag(qs, tag)
    rows = (
        qs.exclude(pk__in=exclude)
        .alias(**aliases)
        .filter(found)
        .select_related("project")
        .defer("config", "notes", "summary")
        .order_by("-created_at", "-id")[:limit]
    )
    return [
        {
            "id": r.pk,
            "name": r.name,
            "status": r.status,
            "status_badge": r.status_badge,
            "last_step": r.last_step,
            "project": r.project.name,
            "tags": list(r.tags or [])[:10],
        }
        for r in rows
    ]


# --- views ---------------------------------------------------------------------------------------


@login_required
@require_GET
def compare_page(request: HttpRequest) -> HttpResponse:
    """The page for ``?runs=``. Without JavaScript its pick section is a plain GET form: ``q``
    (the search, answered in the page) and ``add`` (a run found, one Add button each), which
    answers with a redirect to the link of the new selection, the search kept."""
    runs_param = request.GET.get("runs", "")
    query = request.GET.get("q")
    problem = ""
    if "add" in request.GET:
        link, problem = _added(runs_param, request.GET["add"], query)
        if link:
            return redirect(link)
    context = parts_context(request.user, runs_param)
    context["search_help"] = SEARCH_HELP
    context["query"] = query or ""
    context["full"] = len(context["runs"]) >= MAX_RUNS
    context["found"] = None
    if query is not None and not problem:
        try:
            context["found"] = search(request.user, query, [r.pk for r in context["runs"]])
        except SearchError as err:
            problem = str(err)
        else:
            if context["full"]:
                problem = f"{MAX_RUNS} runs are shown, the most a comparison holds: drop one to add another."
            elif not context["found"]:
                problem = "No run matches."
    context["search_state"] = problem
    return render(request, "pages/runs/compare.html", context)


def _added(runs_param: str, add: str, query: str | None) -> tuple[str, str]:
    """The link of ``runs_param`` with run ``add`` at its end (the page then leaves out a run the
    user may not see, with its note) and no problem; or no link and the problem, naming the fix."""
    added, bad = parse_ids([add])
    if bad or len(added) != 1:
        return "", f"add: {add[:40]!r} is not a run id: pick a run from the search's results"
    wanted, _ = parse_ids([runs_param])
    if added[0] not in wanted:
        if len(wanted) >= MAX_RUNS:
            return "", f"add: a comparison holds at most {MAX_RUNS} runs: drop one to add another"
        wanted.append(added[0])
    link = f"{reverse('compare')}?runs={','.join(str(i) for i in wanted)}"
    return (f"{link}&{urlencode({'q': query})}" if query else link), ""


@login_required
@require_GET
def compare_parts(request: HttpRequest) -> HttpResponse:
    """The runs table, summary and config diff of ``?runs=``, for the page to swap in."""
    return render(
        request, "pages/runs/_compare_parts.html", parts_context(request.user, request.GET.get("runs", ""))
    )


@login_required
@require_GET
def compare_search(request: HttpRequest) -> JsonResponse:
    """``?q=`` (``SEARCH_HELP``) and ``exclude=`` (ids already shown): up to ``SEARCH_LIMIT`` runs."""
    exclude, bad = parse_ids([request.GET.get("exclude", "")])
    if bad:
        return JsonResponse({"detail": f"exclude: {bad[0]!r} is not a run id: give ids as 1,2,3"}, status=400)
    try:
        runs = search(request.user, request.GET.get("q", ""), exclude[: MAX_RUNS * 2])
    except SearchError as err:
        return JsonResponse({"detail": str(err)}, status=400)
    return JsonResponse({"runs": runs, "limit": SEARCH_LIMIT})
