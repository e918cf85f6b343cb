"""The workers page: which machines take runs, from which queues, with what (GPUs, backends)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from jobs.registry import TTL_S
from webapp.api.serializers import workers_out


@login_required
@require_GET
def workers(request: HttpRequest) -> HttpResponse:
    rows = workers_out(request.user)
    queues = sorted({q for w in rows for q in w["queues"]})
    return render(
        request, "pages/workers/workers.html", {"workers": rows, "queues": queues, "ttl": int(TTL_S)}
    )
