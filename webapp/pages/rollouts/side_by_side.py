"""Two runs' completions of the same prompt side by side (issue 18).

From a prompt's card, "Compare with another run" lists the runs of the same project that have
samples of the identical prompt (``?compare=<sample id>``); picking one (``&with=<run id>``) shows both
runs' completions of that prompt, each at its latest step with that prompt or at the step chosen
(``a_step``, ``b_step``). Everything is in the partial's query, so the run page's URL reopens it.

Every lookup by prompt goes through ``Sample.prompt_hash`` and the ``(prompt_hash, run, step)`` index
(migration 0014), on SQLite and PostgreSQL alike; the text itself is compared too, so a hash
collision could only hide a row, never show another prompt's. Cards on both sides are coloured on
one scale, the two runs' combined reward range, so a colour means the same reward left and right.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Max
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from webapp.inputs import INT_MAX, parse_id
from webapp.runs.models import Run, Sample, prompt_hash
from webapp.teams import access

MAX_CANDIDATES = 50  # runs offered, most recently sampled first
MAX_SIDE = 512  # completions of the prompt at one step (rollout.n is at most a few hundred)


def _prompt_samples(run: Run, anchor: Sample) -> Any:
    digest = anchor.prompt_hash or prompt_hash(anchor.prompt)
    return Sample.objects.filter(run=run, prompt_hash=digest, superseded=False)


def candidates(run: Run, anchor: Sample) -> list[dict[str, Any]]:
    """The other runs of ``run``'s project with samples of ``anchor``'s prompt: id, name, latest step
    with it, how many samples of it. One query (the prompt_hash index, then the runs it names)."""
    digest = anchor.prompt_hash or prompt_hash(anchor.prompt)
    rows = (
        Sample.objects.filter(prompt_hash=digest, superseded=False, run__project_id=run.project_id)
        .exclude(run_id=run.pk)
        .values("run_id", "run__name")
        .annotate(latest=Max("step"), count=Count("id"))
        .order_by("-latest", "-run_id")[:MAX_CANDIDATES]
    )
    return [
        {"id": r["run_id"], "name": r["run__name"], "latest": r["latest"], "count": r["count"]} for r in rows
    ]


def _side(run: Run, anchor: Sample, raw_step: str | None, field: str) -> dict[str, Any]:
    """One column: the steps where ``run`` has the prompt, the chosen one (``raw_step``, else the
    latest; a step without the prompt falls to the nearest that has it) and its completions."""
    same = _prompt_samples(run, anchor)
    steps = list(same.order_by("step").values_list("step", flat=True).distinct())
    step = None
    if steps:
        wanted = parse_id(raw_step, INT_MAX) if raw_step else None
        if raw_step and wanted is None:
            raise Http404(f"{field} must be a step number")
        step = steps[-1] if wanted is None else min(steps, key=lambda s: (abs(s - wanted), s))
    rows = list(same.filter(step=step).order_by("seq", "index")[:MAX_SIDE]) if step is not None else []
    rows = [r for r in rows if r.prompt == anchor.prompt]
    return {"run": run, "steps": steps, "step": step, "field": field, "samples": rows}


def _range(sides: list[dict[str, Any]], reward_range: Any) -> tuple[float, float] | None:
    ranges = [r for r in (reward_range(side["run"]) for side in sides) if r is not None]
    if not ranges:
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def compare_view(
    request: HttpRequest,
    run: Run,
    context: dict[str, Any],
    *,
    url: Any,
    groups: Any,
    reward_range: Any,
) -> HttpResponse:
    """The side-by-side partial for ``?compare=<sample id>[&with=<run id>][&a_step=..][&b_step=..]``.
    ``url``, ``groups`` and ``reward_range`` are the browser's own helpers (views.py), passed in so the
    cards are built exactly as everywhere else."""
    if context["shared"]:
        raise Http404("a share link shows one run: comparing with another needs a signed-in member")
    anchor_id = parse_id(request.GET.get("compare"))
    anchor = Sample.objects.filter(run=run, pk=anchor_id).first() if anchor_id is not None else None
    if anchor is None:
        raise Http404("compare: no such sample in this run")
    base_url = context["base_url"]
    raw_other = request.GET.get("with")
    other = None
    if raw_other:
        other_id = parse_id(raw_other)
        if other_id is None:
            raise Http404("with must be a run id")
        try:
            other = access.run_for(request.user, other_id)
        except access.NotFound:
            raise Http404("run not found") from None
        if other.project_id != run.project_id:
            raise Http404("with: runs are compared within one project")
    sides = [_side(run, anchor, request.GET.get("a_step"), "a_step")]
    if other is not None:
        sides.append(_side(other, anchor, request.GET.get("b_step"), "b_step"))
    scale = _range(sides, reward_range)
    for side in sides:
        found = groups(side["samples"], "", scale)
        side["group"] = found[0] if found else None
    context.update(
        anchor=anchor,
        sides=sides,
        other=other,
        candidates=[
            {**c, "url": url(base_url, compare=anchor.pk, **{"with": c["id"]})}
            for c in candidates(run, anchor)
        ],
        reward_range=scale,
        back_url=url(base_url, step=anchor.step),
    )
    return render(request, "pages/rollouts/side_by_side.html", context)
